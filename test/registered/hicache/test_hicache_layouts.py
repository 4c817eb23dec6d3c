"""Reference vs HiCache for every other (layout, io_backend) cell of the MHA host pool, and for
the other write policies and eviction policy: tokens and logprobs identical, prefixes loaded
back from host. (layer_first + direct runs per commit in test_hicache_e2e.py.)

The kernel cells run the Triton copy kernel under TRITON_INTERPRET=1 (run_suite sets it on
CPU), so they exercise the real kernel through the serving path.
"""

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals, wait_idle_check

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=120, suite="nightly-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048"]
SMALL_DEVICE = ["--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8"]
WORKLOAD = {"clients": 6, "rounds": 3}


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_workload(srv, **WORKLOAD)


def run_hicache(model, *flags) -> tuple[list, dict]:
    with launch_server_process(model, *COMMON, *SMALL_DEVICE, *flags) as srv:
        turns = run_workload(srv, **WORKLOAD)
        assert srv.get("/health").status_code == 200
        return turns, wait_idle_check(srv)


@pytest.mark.parametrize("layout, io_backend", [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("page_first_direct", "direct"),
    ("page_first_direct", "kernel"),
    ("page_head", "kernel"),
])
def test_layout_io_cell(model, reference, layout, io_backend):
    turns, counters = run_hicache(model, "--hicache-mem-layout", layout, "--hicache-io-backend", io_backend)
    assert_same_tokens(reference, turns)
    assert tier_totals(turns)["host"] > 0
    assert counters["num_idle_checks"] > 0


def test_direct_with_page_first_becomes_page_first_direct(model, reference):
    with launch_server_process(model, *COMMON, *SMALL_DEVICE, "--hicache-mem-layout", "page_first",
                               "--hicache-io-backend", "direct") as srv:
        assert srv.get("/get_server_info").json()["hicache_mem_layout"] == "page_first_direct"
        turns = run_workload(srv, **WORKLOAD)
        assert "using page_first_direct" in srv.log_tail(400)
    assert_same_tokens(reference, turns)


@pytest.mark.parametrize("flags", [
    ["--hicache-write-policy", "write_through_selective"],
    ["--hicache-write-policy", "write_back"],
    ["--radix-eviction-policy", "lfu"],
])
def test_write_and_eviction_policies(model, reference, flags):
    turns, _ = run_hicache(model, *flags)
    assert_same_tokens(reference, turns)
    assert tier_totals(turns)["host"] > 0
