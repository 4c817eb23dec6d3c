"""Qwen3-Next served with the issue-28 workload shape: prefix hits where conversations expect them.

Four conversations x three rounds sharing a 160-token system prompt (40-token questions, 8-token
answers, page size 16), sent one after another, on:

- the default invocation (no ``--enable-hierarchical-cache``): it starts, with the device-only
  ``MambaRadixCache``;
- a HiCache server (``HiMambaRadixCache``);

each with and without chunked prefill. State checkpoints taken inside prefill forwards (where a
prompt leaves the cached prefix, the last page before a prompt's end) make every round after the
first hit, and the shared system prompt hit for later conversations. Every output equals HF
transformers' greedy ``generate``; the idle integrity check (state pool included) passes.
"""

import pytest
from hicache_workload import run_workload, wait_idle_check
from model_e2e import assert_equal_hf_generate

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


@pytest.mark.parametrize("chunked", ["-1", "64"])
@pytest.mark.parametrize("server", SERVERS)
def test_multi_turn_hits_and_outputs_equal_hf(qwen3_next, server, chunked):
    with launch_server_process(qwen3_next, *COMMON, "--chunked-prefill-size", chunked, *SERVERS[server]) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_equal_hf_generate(qwen3_next, turns)
    hit = {(t.client, t.round): t.cached.get("device", 0) + t.cached.get("host", 0) for t in turns}
    for (client, rnd), n in hit.items():
        if rnd > 0:  # the conversation's previous turn left a state at its prompt's last page
            assert n >= (SYSTEM + 40) // PAGE * PAGE, (client, rnd, hit)
    # the second conversation checkpointed the system prompt's end: later ones hit at least there
    # (64-token chunks: the first conversation's chunk end at 128 already)
    assert all(hit[(c, 0)] >= (SYSTEM if chunked == "-1" else 128) for c in (2, 3)), hit
