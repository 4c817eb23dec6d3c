"""test_multiturn_load.py's closed-loop and open-loop (file L3) cases with noisy neighbours: 4
processes (2 CPU-bound, 2 file-I/O; scripts/bench/noisy_neighbours.py) run beside the servers for
the whole test. Tokens must still equal the HiCache-off server's (run beside the same
neighbours), with host hits shown and the idle integrity check passing."""

import json
import os
import sys

import pytest
from hicache_workload import assert_same_tokens, run_open_loop, run_workload, tier_totals, wait_idle_check

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT, make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=60, suite="nightly-cpu")

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts", "bench"))
from noisy_neighbours import NoisyNeighbours  # noqa: E402

WORKLOAD = {"clients": 8, "rounds": 4, "system_len": 600, "question_len": 80, "max_new": 24}
COMMON = ["--page-size", "16", "--context-length", "2048", "--max-total-tokens", "1100"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "8"]
LOGPROB_TOL = 0.0  # as in test_multiturn_load.py


@pytest.fixture(scope="module")
def neighbours():
    with NoisyNeighbours(4) as n:
        assert all(p.is_alive() for p in n.procs)
        yield n


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny4")), "qwen3", "--layers", "4")


@pytest.fixture(scope="module")
def reference(model4, neighbours):
    with launch_server_process(model4, *COMMON) as srv:
        return run_workload(srv, **WORKLOAD)


def test_closed_loop_with_neighbours(model4, reference, neighbours):
    with launch_server_process(model4, *COMMON, *HICACHE) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert_same_tokens(reference, turns, LOGPROB_TOL)
        assert tier_totals(turns)["host"] > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0
    assert all(p.is_alive() for p in neighbours.procs)  # the load really lasted


def test_open_loop_file_storage_with_neighbours(model4, reference, neighbours, tmp_path):
    extra = json.dumps({"storage_dir": str(tmp_path / "l3")})
    flags = [*COMMON, *HICACHE, "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra]
    with launch_server_process(model4, *flags) as srv:
        turns = run_open_loop(srv, **WORKLOAD, rate_per_client=8.0)
        assert_same_tokens(reference, turns, LOGPROB_TOL)
        assert tier_totals(turns)["host"] > 0
        assert wait_idle_check(srv)["num_idle_checks"] > 0
