"""Qwen3-Next served with the issue-28 workload shape: prefix hits where conversations expect them.

Four conversations x three rounds sharing a 160-token system prompt (40-token questions, 8-token
answers, page size 16), sent one after another, on:

- the default invocation (no ``--enable-hierarchical-cache``): it starts, with the device-only
  ``MambaRadixCache``;
- a HiCache server (``HiMambaRadixCache``);

each with and without chunked prefill; and a HiCache server with a device pool too small for the
four conversations and a file L3, restarted on its L3 directory. State checkpoints taken inside prefill forwards (where a
prompt leaves the cached prefix, the last page before a prompt's end) make every round after the
first hit, and the shared system prompt hit for later conversations; evicted conversations come
back from host, and after the restart from storage. Every output equals HF
transformers' greedy ``generate``; the idle integrity check (state pool included) passes.
"""

import pytest
from hicache_workload import run_workload, tier_totals, wait_idle_check
from model_e2e import assert_equal_hf_generate, file_l3_flags
from test_hicache_storage import wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=40, suite="nightly-cpu")

SYSTEM, PAGE = 160, 16
WORKLOAD = {"clients": 4, "rounds": 3, "system_len": SYSTEM, "question_len": 40, "max_new": 8, "concurrent": False}
COMMON = ["--context-length", "2048", "--page-size", str(PAGE), "--max-total-tokens", "8192"]
SERVERS = {"default": [], "hicache": ["--enable-hierarchical-cache", "--hicache-ratio", "2"]}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", "--layers", "4")


def _later_rounds_hit(turns, tiers: tuple[str, ...]) -> dict:
    """Each later round hits (in ``tiers``) at least its previous turn's prompt, in whole pages."""
    hit = {(t.client, t.round): sum(t.cached.get(k, 0) for k in tiers) for t in turns}
    for (client, rnd), n in hit.items():
        if rnd > 0:  # the conversation's previous turn left a state at its prompt's last page
            assert n >= (SYSTEM + 40) // PAGE * PAGE, (client, rnd, hit)
    return hit


@pytest.mark.parametrize("chunked", ["-1", "64"])
@pytest.mark.parametrize("server", SERVERS)
def test_multi_turn_hits_and_outputs_equal_hf(qwen3_next, server, chunked):
    with launch_server_process(qwen3_next, *COMMON, "--chunked-prefill-size", chunked, *SERVERS[server]) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_equal_hf_generate(qwen3_next, turns)
    hit = _later_rounds_hit(turns, ("device", "host"))
    # the second conversation checkpointed the system prompt's end: later ones hit at least there
    # (64-token chunks: the first conversation's chunk end at 128 already)
    assert all(hit[(c, 0)] >= (SYSTEM if chunked == "-1" else 128) for c in (2, 3)), hit


def test_host_hits_then_storage_hits_after_restart(qwen3_next, tmp_path):
    """A 384-token device pool holds about one conversation: between a conversation's rounds the
    three others evict it to host, so its next round hits host; a fresh server on the same file L3
    directory then serves the replayed workload's prefixes (KV pages and states) from storage."""
    flags = [*COMMON[:-2], "--max-total-tokens", "384", "--chunked-prefill-size", "-1",
             "--enable-hierarchical-cache", "--hicache-ratio", "8", *file_l3_flags(str(tmp_path / "l3"))]
    with launch_server_process(qwen3_next, *flags) as srv:
        first = run_workload(srv, **WORKLOAD)
        assert wait_backed_up(srv) > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    _later_rounds_hit(first, ("device", "host"))
    assert tier_totals(first)["host"] > 0, tier_totals(first)
    with launch_server_process(qwen3_next, *flags) as srv:
        again = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    totals = tier_totals(again)
    assert totals["storage"] >= SYSTEM // PAGE * PAGE, totals  # at least the first prompt's system prompt
    assert_equal_hf_generate(qwen3_next, first + again)
