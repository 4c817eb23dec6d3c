"""L3 storage through the serving path: after /flush_cache empties device and host, the same
conversation is served from the file backend (metadata shows storage tokens) with the reference's
tokens. The nightly variants (restart on the same directory, NIXL) are in
test_hicache_storage_nightly.py.

A bad backend option stops the server at start-up naming the flags.
"""

import json

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals
from prometheus_client.parser import text_string_to_metric_families

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process, run_launcher

register_cpu_ci(est_time=20, suite="per-commit-cpu")

COMMON = ["--page-size", "4", "--context-length", "2048"]
WORKLOAD = {"clients": 4, "rounds": 2}
# upstream's HiCache names (docs/server.md, Metrics)
UPSTREAM_HICACHE = (
    "sglang:prefetched_tokens_total", "sglang:backuped_tokens_total", "sglang:storage_prefetch_hit_tokens_total",
    "sglang:storage_prefetch_unfulfilled_tokens_total", "sglang:storage_prefetch_deferred_tokens_total",
    "sglang:hicache_backup_duration_seconds_count", "sglang:hicache_backup_bytes_total",
    "sglang:hicache_backup_tokens_total", "sglang:load_back_duration_seconds_count", "sglang:load_back_tokens_total",
    "sglang:load_back_bytes_total", "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
    "sglang:cached_tokens_total",
)


def storage_flags(backend: str, storage_dir: str) -> list[str]:
    return [*COMMON, "--max-total-tokens", "512", "--enable-hierarchical-cache", "--hicache-ratio", "8",
            "--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config",
            json.dumps({"storage_dir": storage_dir, "prefetch_threshold": 4})]  # default 256 > these prompts


def launch_storage_server(model, backend: str, storage_dir: str):
    return launch_server_process(model, *storage_flags(backend, storage_dir))


def wait_backed_up(server, timeout: float = 30) -> int:
    """Poll /metrics until the storage write count stops growing; returns pages written."""
    import time

    last, stable, deadline = -1, 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.get("/get_server_info").json()["scheduler"]["storage"]
        written = stats.get("pages_written", 0)
        stable = stable + 1 if written == last and written > 0 else 0
        if stable >= 5:
            return written
        last = written
        time.sleep(0.1)
    raise AssertionError(f"storage writes did not settle (last {last})")


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_workload(srv, **WORKLOAD)


def test_file_storage_serves_after_flush(model, reference, tmp_path):
    with launch_storage_server(model, "file", str(tmp_path / "l3")) as srv:
        first = run_workload(srv, **WORKLOAD)
        assert_same_tokens(reference, first)
        assert wait_backed_up(srv) > 0
        assert srv.post("/flush_cache").status_code == 200
        again = run_workload(srv, **WORKLOAD)
        assert_same_tokens(reference, again)
        totals = tier_totals(again)
        assert totals["storage"] > 0, totals
        metrics = srv.get("/metrics").text
        assert "sglang:storage_operations_total" in metrics and 'tier="storage"' in metrics
        samples = {}  # sample name -> sum over its series, per cache_source for cached tokens
        for fam in text_string_to_metric_families(metrics):
            for x in fam.samples:
                name = x.name + (f"/{x.labels['cache_source']}" if "cache_source" in x.labels else "")
                samples[name] = samples.get(name, 0) + x.value
        missing = [n for n in UPSTREAM_HICACHE if n not in samples and n + "/storage" not in samples]
        assert not missing, missing
        assert samples["sglang:cached_tokens_total/storage"] >= totals["storage"]  # counted over both runs
        assert samples["sglang:prefetched_tokens_total"] >= totals["storage"] > 0
        assert samples["sglang:backuped_tokens_total"] > 0 and samples["sglang:load_back_tokens_total"] > 0


def test_bad_backend_option_stops_startup_naming_the_flags(model, tmp_path):
    flags = storage_flags("file", str(tmp_path))
    flags[flags.index("--hicache-storage-backend-extra-config") + 1] = json.dumps({"no_such_key": 1})
    proc = run_launcher(model, *flags)
    assert proc.returncode == 1
    for word in ("--hicache-storage-backend file", "--hicache-storage-backend-extra-config", "no_such_key"):
        assert word in proc.stderr, proc.stderr[-2000:]
