"""Prometheus text rendering: histogram buckets, counter and gauge samples, storage section."""

import re

from sglang.srt.metrics.collector import Histogram, RequestMetrics, render_metrics
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (-?[0-9.e+-]+|\+Inf)$')


def snapshot(storage=None) -> dict:
    return {
        "counters": {"prompt_tokens": 100, "generation_tokens": 20, "num_requests": 3, "num_aborted": 1,
                     "cached_tokens": {"device": 40, "host": 24, "storage": 8}},
        "num_running_reqs": 2, "num_waiting_reqs": 5,
        "pools": {"device": {"capacity_tokens": 512, "used_tokens": 100},
                  "host": {"capacity_tokens": 4096, "used_tokens": 300}},
        "storage": storage or {},
    }


def parse(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = h.lines("t", 'a="b"')
    assert lines == ['t_bucket{a="b",le="0.1"} 2', 't_bucket{a="b",le="1.0"} 3', 't_bucket{a="b",le="+Inf"} 4',
                     't_sum{a="b"} 3.65', 't_count{a="b"} 4']


def test_render_has_every_tier_and_the_ttft_histogram():
    req = RequestMetrics()
    req.time_to_first_token.observe(0.02)
    req.time_to_first_token.observe(2.0)
    text = render_metrics(snapshot(), req, "m")
    samples = parse(text)
    base = 'model_name="m"'
    assert samples[("sglang:cached_tokens_total", base + ',tier="device"')] == 40
    assert samples[("sglang:cached_tokens_total", base + ',tier="host"')] == 24
    assert samples[("sglang:cached_tokens_total", base + ',tier="storage"')] == 8
    assert samples[("sglang:cache_pool_used_tokens", base + ',tier="host"')] == 300
    assert samples[("sglang:cache_pool_capacity_tokens", base + ',tier="device"')] == 512
    assert samples[("sglang:num_waiting_reqs", base)] == 5
    assert samples[("sglang:time_to_first_token_seconds_count", base)] == 2
    assert samples[("sglang:time_to_first_token_seconds_bucket", base + ',le="0.025"')] == 1
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text
    assert "sglang:storage_operations_total" not in text  # no backend, no storage section


def test_storage_counters_rendered_when_a_backend_reports():
    storage = {"pages_hit": 7, "pages_missed": 2, "pages_written": 9, "pages_skipped": 0, "failures": 1,
               "corruptions": 3, "bytes_read": 70, "bytes_written": 90, "prefetch_ops": 4, "backup_pages_failed": 2}
    snap = snapshot(storage)
    snap["host_transfers"] = {"pages_written": 11, "pages_loaded": 5, "failures": 0}
    samples = parse(render_metrics(snap, RequestMetrics(), "m"))
    assert samples[("sglang:host_transfer_pages_total", 'model_name="m",direction="host_to_device"')] == 5
    assert samples[("sglang:storage_prefetch_events_total", 'model_name="m",event="ops"')] == 4
    assert samples[("sglang:storage_backup_events_total", 'model_name="m",event="pages_failed"')] == 2
    assert samples[("sglang:storage_operations_total", 'model_name="m",op="pages_hit"')] == 7
    assert samples[("sglang:storage_failures_total", 'model_name="m",kind="corruptions"')] == 3
    assert samples[("sglang:storage_bytes_total", 'model_name="m",direction="written"')] == 90
