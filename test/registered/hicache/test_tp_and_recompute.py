"""Against the reference (TP=1, device pool holding everything):

* prefix cache disabled: every prefix is recomputed instead of reused. Stated tolerance: the same
  greedy tokens and logprobs within 1e-4 (the engine is batch-invariant, so on CPU they are
  in fact bit-identical; 1e-4 leaves room for other BLAS builds).
* TP=2 over gloo with HiCache and a small device pool (both ranks' trees agree through the TP
  group): the same tokens for these fixed prompts, logprobs within 1e-4 (all-reduce order).
"""

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=30, suite="per-commit-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048"]
WORKLOAD = {"clients": 4, "rounds": 3}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_workload(srv, **WORKLOAD)


def test_prefix_cache_disabled_within_tolerance(model, reference):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "4096", "--disable-radix-cache") as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, turns, logprob_tol=LOGPROB_TOL)
    assert tier_totals(turns) == {"device": 0, "host": 0, "storage": 0}
    assert tier_totals(reference)["device"] > 0


def test_tp2_hicache_matches_tp1(model, reference):
    flags = [*COMMON, "--tp-size", "2", "--max-total-tokens", "384", "--enable-hierarchical-cache",
             "--hicache-ratio", "8"]
    with launch_server_process(model, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert_same_tokens(reference, turns, logprob_tol=LOGPROB_TOL)
    assert tier_totals(turns)["host"] > 0
