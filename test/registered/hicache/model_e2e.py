"""What every per-architecture served e2e test checks, on a tiny checkpoint written by HF
transformers (``make_tiny_model --arch ...``): a multi-turn workload on a device pool far smaller
than its working set (``SMALL_DEVICE``), against a reference server whose pool holds everything.

- ``check_host_then_storage``: host hits on the first pass, file-L3 writes, then storage hits,
  either after ``/flush_cache`` or on a fresh server over the same directory; greedy tokens and
  logprobs equal the reference's bit for bit; the idle integrity check (every pool, device and
  host) passed.
- ``assert_equal_hf_generate``: the reference's tokens equal HF ``generate`` on the same ids.
- ``assert_cell_refused``: a layout / io backend cell the model's pools cannot honour stops the
  server at start-up, naming the pool and its supported cells.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check
from test_hicache_storage import wait_backed_up

from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.test.server_utils import launch_server_process, run_launcher

COMMON = ["--page-size", "4", "--context-length", "2048"]
SMALL_DEVICE = ["--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8"]
REFERENCE = ["--max-total-tokens", "16384"]
WORKLOAD = {"clients": 4, "rounds": 3}


def file_l3_flags(storage_dir: str, backend: str = "file") -> list[str]:
    """The L3 flags (``backend`` over ``storage_dir``, prefetch waits for every page)."""
    return ["--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps({"storage_dir": storage_dir, "prefetch_threshold": 4})]


def run_reference(model: str, *flags: str):
    with launch_server_process(model, *COMMON, *REFERENCE, *flags) as srv:
        return run_workload(srv, **WORKLOAD)


def check_host_then_storage(model: str, reference, storage_dir: str, *flags: str, restart: bool = False,
                            logprob_tol: float = 0.0, log_words: tuple[str, ...] = (),
                            check_server: Callable | None = None) -> None:
    """Pass 1 with host hits and L3 writes; pass 2 (after /flush_cache, or on a fresh server when
    ``restart``) with storage hits; both equal ``reference`` (same prompts too); idle integrity
    checks passed. ``check_server(srv)`` runs on the first server before its workload."""
    all_flags = [*COMMON, *SMALL_DEVICE, *flags, *file_l3_flags(storage_dir)]

    def second_pass(srv) -> None:
        again = run_workload(srv, **WORKLOAD)
        assert_same_tokens(reference, again, logprob_tol)
        assert tier_totals(again)["storage"] > 0, tier_totals(again)
        assert wait_idle_check(srv)["num_idle_checks"] > 0  # a failed integrity check kills the server
        assert srv.get("/health").status_code == 200

    with launch_server_process(model, *all_flags) as srv:
        log = srv.log_tail(400)
        for word in log_words:
            assert word in log, (word, log[-2000:])
        if check_server is not None:
            check_server(srv)
        first = run_workload(srv, **WORKLOAD)
        assert [t.prompt for t in first] == [t.prompt for t in reference]
        assert_same_tokens(reference, first, logprob_tol)
        assert tier_totals(first)["host"] > 0, tier_totals(first)
        assert wait_backed_up(srv) > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0
        if not restart:
            assert srv.post("/flush_cache").status_code == 200
            second_pass(srv)
    if restart:
        with launch_server_process(model, *all_flags) as srv:
            second_pass(srv)


def run_checked(model: str, reference, *flags: str, logprob_tol: float = 0.0, workload: dict | None = None):
    """The workload (``WORKLOAD`` unless given) on a server started with ``flags``: the idle
    integrity check passed and the turns equal ``reference``'s. Returns the turns."""
    with launch_server_process(model, *flags) as srv:
        turns = run_workload(srv, **(workload or WORKLOAD))
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, turns, logprob_tol)
    return turns


def assert_equal_hf_generate(model: str, turns, min_prompt_len: int = 0) -> None:
    """Each turn's output equals HF greedy ``generate`` on its prompt (EOS not special: the
    workload's requests ignore it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    assert min(len(t.prompt) for t in turns) > min_prompt_len
    with torch.no_grad():
        for turn in turns:
            n = len(turn.output_ids)
            out = hf.generate(torch.tensor([turn.prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0, eos_token_id=None)
            assert out[0, len(turn.prompt):].tolist() == turn.output_ids, f"client {turn.client} round {turn.round}"


def assert_cell_refused(model: str, kind, layout: str, io_backend: str, *words: str,
                        flags: tuple[str, ...] = (*COMMON, *SMALL_DEVICE)) -> None:
    """Start-up with ``flags`` and this cell exits 1 naming the layout, the pool kind, ``words``
    and every cell ``kind`` supports."""
    proc = run_launcher(model, *flags, "--hicache-mem-layout", layout, "--hicache-io-backend", io_backend)
    assert proc.returncode == 1, proc.stderr[-2000:]
    cells = [f"{lay}+{io}" for lay, io in supported_cells(kind)]
    for word in (layout, kind.value, *words, *cells):
        assert word in proc.stderr, (word, proc.stderr[-2000:])
