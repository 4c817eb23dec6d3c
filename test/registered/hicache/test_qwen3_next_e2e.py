"""Qwen3-Next (linear-attention state + full-attention KV) served over HTTP, checked against HF.

The tiny checkpoint is written by transformers (make_tiny_model --arch qwen3_next: linear, full,
linear, full; Gated DeltaNet + MoE with a shared expert). A multi-turn workload runs on:

- a reference server with ``--disable-radix-cache`` (every request starts from a zero state; its
  own Mamba slot carries the state across prefill chunks and decode): tokens equal HF
  ``generate`` on the same prompts;
- a HiCache server (``HiMambaRadixCache`` over the MHA pool + the Mamba pool, page size 1 so every
  finished request leaves a state at its end) whose device pool (256 tokens) is far smaller than
  the working set: prefixes come back from host with their states; then a fresh server on the
  same file L3 directory restores KV and states from storage. Greedy tokens and logprobs equal the
  reference's (logprobs within LOGPROB_TOL: a prefix hit resumes the gated delta rule at the hit
  instead of inside one prefill chunk, which rounds differently), and the idle integrity check
  (both Mamba pools included) passes.

A HiCache cell the Mamba pool does not support stops the server at start-up, naming the pool and
its supported cells. (HF agreement and the refusal are the shared checks of ``model_e2e.py``.)
"""

import pytest
from hicache_workload import (
    GREEDY,
    assert_same_tokens,
    run_workload,
    tier_totals,
    wait_idle_check,
)
from model_e2e import assert_cell_refused, assert_equal_hf_generate, file_l3_flags
from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process
from test_hicache_storage import wait_backed_up

register_cpu_ci(est_time=30, suite="per-commit-cpu")

LOGPROB_TOL = 1e-4
COMMON = ["--context-length", "2048", "--chunked-prefill-size", "64"]
SMALL_DEVICE = ["--page-size", "4", "--max-total-tokens", "256", "--enable-hierarchical-cache", "--hicache-ratio", "16"]
WORKLOAD = {"clients": 3, "rounds": 3}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", "--layers", "4")


@pytest.fixture(scope="module")
def reference(qwen3_next):
    with launch_server_process(qwen3_next, *COMMON, "--page-size", "4", "--disable-radix-cache",
                               "--max-total-tokens", "8192") as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
        yield turns


def run_later_rounds(srv, reference) -> int:
    """Send the prompts of rounds > 0 directly (each one's history ends where an earlier turn left a
    state); outputs must equal the reference's. Returns the prompt tokens served from storage."""
    storage = 0
    for ref in reference:
        if ref.round == 0:
            continue
        out = srv.generate(input_ids=ref.prompt, sampling_params={"max_new_tokens": len(ref.output_ids), **GREEDY},
                           return_logprob=True)
        assert out["output_ids"] == ref.output_ids, f"client {ref.client} round {ref.round}"
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(logprobs, ref.logprobs)) <= LOGPROB_TOL
        storage += out["meta_info"]["cached_tokens_details"]["storage"]
    return storage


def test_reference_server_matches_hf_generate(qwen3_next, reference):
    assert_equal_hf_generate(qwen3_next, reference)
    assert len({t for turn in reference for t in turn.output_ids}) > 4


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("l3"))


@pytest.fixture(scope="module")
def hicache(qwen3_next, storage_dir):
    flags = [*COMMON, *SMALL_DEVICE, *file_l3_flags(storage_dir)]
    with launch_server_process(qwen3_next, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        counters = wait_idle_check(srv)
        wait_backed_up(srv)  # L3 holds the pages (and states) before the restart test reads them
        yield turns, counters


def test_host_hits_restore_state(reference, hicache):
    turns, counters = hicache
    assert_same_tokens(reference, turns, LOGPROB_TOL)
    totals = tier_totals(turns)
    assert totals["host"] > 0, totals  # prefixes (KV and the state after them) came back from host
    assert counters["num_idle_checks"] > 0  # HiMambaRadixCache.check_integrity covered both Mamba pools


def test_restart_on_same_l3_restores_state(qwen3_next, storage_dir, reference, hicache):
    """A fresh server (empty device and host tiers) on the first one's L3 directory: the later
    rounds' histories can only come from storage, KV pages and the state after them."""
    with launch_server_process(qwen3_next, *COMMON, *SMALL_DEVICE, *file_l3_flags(storage_dir)) as srv:
        assert run_later_rounds(srv, reference) > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0


def test_unsupported_cell_is_refused_naming_the_mamba_pool(qwen3_next):
    """page_head + kernel serves the MHA anchor but not the Mamba pool: refused at start-up."""
    assert ("page_head", "kernel") in supported_cells(PoolKind.MHA)
    assert ("page_head", "kernel") not in supported_cells(PoolKind.MAMBA)
    assert_cell_refused(qwen3_next, PoolKind.MAMBA, "page_head", "kernel", "mamba pool", "MambaPool",
                        flags=(*COMMON, *SMALL_DEVICE))
