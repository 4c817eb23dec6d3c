"""Reference vs HiCache, real servers over HTTP: the HiCache server's device pool is far smaller
than the multi-turn working set, so prefixes are evicted to host and loaded back; greedy tokens
and logprobs must equal the reference's (device pool holding everything) bit for bit.

This file runs one (layout, io_backend) cell per commit; test_hicache_layouts.py runs the rest.
"""

import pytest
from prometheus_client.parser import text_string_to_metric_families
from hicache_workload import assert_same_tokens, run_workload, server_counters, tier_totals, wait_idle_check

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=25, suite="per-commit-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048", "--served-model-name", "tiny"]
SMALL_DEVICE = ["--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8"]


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_workload(srv, clients=6, rounds=3)


@pytest.fixture(scope="module")
def hicache(model):
    flags = [*COMMON, *SMALL_DEVICE, "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "direct"]
    with launch_server_process(model, *flags) as srv:
        turns = run_workload(srv, clients=6, rounds=3)
        yield srv, turns


def test_tokens_identical_to_reference_with_eviction_and_load_back(reference, hicache):
    srv, turns = hicache
    assert_same_tokens(reference, turns)
    totals = tier_totals(turns)
    assert totals["host"] > 0, totals  # prefixes really came back from host
    assert tier_totals(reference)["host"] == 0


def test_metrics_and_meta_agree_on_tiers(hicache):
    srv, turns = hicache
    totals = tier_totals(turns)
    counters = server_counters(srv)
    assert counters["cached_tokens"] == totals
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(srv.get("/metrics").text) for s in fam.samples}

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]

    assert value("sglang:cached_tokens_total", tier="host", cache_source="host") == totals["host"]
    assert value("sglang:cache_pool_capacity_tokens", tier="host") == 4096
    assert value("sglang:cache_pool_capacity_tokens", tier="device") == 512
    assert value("sglang:host_transfer_pages_total", direction="host_to_device") * 4 >= totals["host"]  # 4-token pages


def test_idle_integrity_checks_ran_and_flush_frees_both_tiers(hicache):
    srv, _ = hicache
    assert wait_idle_check(srv)["num_idle_checks"] > 0  # a failed check would have killed the server
    assert srv.get("/health").status_code == 200
    assert srv.post("/flush_cache").status_code == 200
    pools = srv.get("/get_server_info").json()["scheduler"]["pools"]
    assert pools["device"]["used_tokens"] == 0 and pools["host"]["used_tokens"] == 0
