"""DeepSeek-V2 / V3 (MLA pool, MoE) and V3.2 (MLA + DSA indexer sidecar) served with HiCache and
file L3, against a reference server and HF.

A multi-turn workload whose working set is larger than the HiCache server's device pool: prefixes
are evicted to host and loaded back (host hits in ``meta_info``), written to the file backend, and
after ``/flush_cache`` served from it (storage hits). Greedy tokens and logprobs equal the
reference server's (device pool holding everything) bit for bit, and the tokens equal HF
``generate`` on the same input ids. For V3.2 the indexer keys move with the latent (one
HostPoolGroup) between tiers and through L3; its prompts (88+ tokens) are past index_topk (16),
so attention is sparse. The NIXL / TP=2 / layout-matrix variants are in
test_deepseek_e2e_nightly.py.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from hicache_workload import GREEDY, Turn, assert_same_tokens, tier_totals
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process
from test_hicache_storage import storage_flags, wait_backed_up

register_cpu_ci(est_time=45, suite="per-commit-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048"]
CLIENTS, ROUNDS, MAX_NEW = 4, 3, 8


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def model(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)


def run_conversations(server, clients: int = CLIENTS, rounds: int = ROUNDS, seed: int = 0):
    """``clients`` conversations sharing a 48-token system prompt, each turn the whole history plus
    40 new tokens; clients of a round run concurrently. Returns (turns, prompts) in round order."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 999) for _ in range(48)]
    questions = [[[rng.randrange(3, 999) for _ in range(40)] for _ in range(clients)] for _ in range(rounds)]
    history = [list(system) for _ in range(clients)]
    turns, prompts = [], []

    def one(c: int, r: int):
        prompt = history[c] + questions[r][c]
        out = server.generate(input_ids=prompt, sampling_params={"max_new_tokens": MAX_NEW, **GREEDY},
                              return_logprob=True)
        meta = out["meta_info"]
        history[c] = prompt + out["output_ids"]
        turn = Turn(c, r, out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
                    meta["cached_tokens_details"])
        return turn, prompt

    with ThreadPoolExecutor(max_workers=clients) as pool:
        for r in range(rounds):
            for turn, prompt in pool.map(lambda c, r=r: one(c, r), range(clients)):
                turns.append(turn)
                prompts.append(prompt)
    return turns, prompts


def assert_matches_hf(model_path: str, turns, prompts) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for turn, prompt in zip(turns, prompts, strict=True):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)  # the servers ignore EOS
            want = out[0, len(prompt):].tolist()
            assert turn.output_ids == want, f"client {turn.client} round {turn.round}: {turn.output_ids} != HF {want}"


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_conversations(srv)


def test_hicache_file_l3_matches_reference_and_hf(model, reference, tmp_path):
    pytest.importorskip("transformers")
    ref_turns, ref_prompts = reference
    with launch_server_process(model, *storage_flags("file", str(tmp_path / "l3"))) as srv:
        info = srv.get("/get_server_info").json()
        assert info["scheduler"]["pools"]["device"]["capacity_tokens"] == 512
        first, prompts = run_conversations(srv)
        assert prompts == ref_prompts
        assert_same_tokens(ref_turns, first)
        assert tier_totals(first)["host"] > 0, tier_totals(first)  # evicted prefixes came back from host
        assert wait_backed_up(srv) > 0
        assert srv.post("/flush_cache").status_code == 200
        again, _ = run_conversations(srv)
        assert_same_tokens(ref_turns, again)
        assert tier_totals(again)["storage"] > 0, tier_totals(again)
    assert tier_totals(ref_turns)["host"] == 0
    # Every stored page has its latent object, and (V3.2) its indexer object beside it.
    names = [n for _, _, files in os.walk(tmp_path / "l3") for n in files]
    indexer = [n for n in names if "_indexer" in n]
    assert len(names) > len(indexer) > 0 if "v32" in model else not indexer, sorted(names)[:6]
    if indexer:
        assert len(indexer) == len(names) - len(indexer)
    assert_matches_hf(model, ref_turns, ref_prompts)


def test_unsupported_layout_cell_is_refused_naming_the_mla_cells(model):
    from sglang.test.server_utils import run_launcher

    if "v2" not in model:
        pytest.skip("one architecture is enough for a start-up refusal")

    proc = run_launcher(model, *COMMON, "--max-total-tokens", "512", "--enable-hierarchical-cache",
                        "--hicache-mem-layout", "page_head", "--hicache-io-backend", "kernel")
    assert proc.returncode == 1
    assert "mla" in proc.stderr and "layer_first+direct" in proc.stderr, proc.stderr[-2000:]
