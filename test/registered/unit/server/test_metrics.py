"""The /metrics page (prometheus_client): upstream's names and buckets, our tier and storage
families, and the HTTP-side figures (TTFT, ITL, E2E, throughput window, hit rate)."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.metrics.collector import ITL_BUCKETS_S, THROUGHPUT_WINDOW_S, TTFT_BUCKETS_S, RequestMetrics, \
    render_metrics
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def snapshot(storage=None) -> dict:
    return {
        "counters": {"prompt_tokens": 100, "generation_tokens": 20, "num_requests": 3, "num_aborted": 1,
                     "cached_tokens": {"device": 40, "host": 24, "storage": 8}},
        "num_running_reqs": 2, "num_waiting_reqs": 5,
        "pools": {"device": {"capacity_tokens": 512, "used_tokens": 128},
                  "host": {"capacity_tokens": 4096, "used_tokens": 300}},
        "storage": storage or {},
    }


def parse(text: str) -> tuple[dict, dict]:
    """(family name -> type, (sample name, sorted labels) -> value), by prometheus_client's parser."""
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def key(name: str, **labels) -> tuple:
    return name, tuple(sorted({"model_name": "m", **labels}.items()))


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_upstream_names_types_and_snapshot_values():
    types, samples = parse(render_metrics(snapshot(), RequestMetrics("m")))
    for name, kind in [("sglang:prompt_tokens", "counter"), ("sglang:generation_tokens", "counter"),
                       ("sglang:num_requests", "counter"), ("sglang:num_aborted_requests", "counter"),
                       ("sglang:cached_tokens", "counter"), ("sglang:num_running_reqs", "gauge"),
                       ("sglang:num_queue_reqs", "gauge"), ("sglang:num_used_tokens", "gauge"),
                       ("sglang:token_usage", "gauge"), ("sglang:gen_throughput", "gauge"),
                       ("sglang:cache_hit_rate", "gauge"), ("sglang:time_to_first_token_seconds", "histogram"),
                       ("sglang:inter_token_latency_seconds", "histogram"),
                       ("sglang:e2e_request_latency_seconds", "histogram")]:
        assert types[name] == kind, name
    assert samples[key("sglang:prompt_tokens_total")] == 100
    assert samples[key("sglang:generation_tokens_total")] == 20
    assert samples[key("sglang:cached_tokens_total", tier="host", cache_source="host")] == 24
    assert samples[key("sglang:num_queue_reqs")] == 5 == samples[key("sglang:num_waiting_reqs")]
    assert samples[key("sglang:num_used_tokens")] == 128
    assert samples[key("sglang:token_usage")] == 0.25
    assert samples[key("sglang:cache_pool_capacity_tokens", tier="device")] == 512
    assert samples[key("sglang:cache_pool_used_tokens", tier="host")] == 300
    assert ("sglang:storage_operations_total", ()) not in samples
    assert not any(name.startswith("sglang:storage_") for name, _ in samples)  # no backend, no storage section


def test_histograms_use_upstream_buckets_and_itl_splits_the_interval():
    req = RequestMetrics("m")
    req.on_first_token(0.15)
    req.on_first_token(3.0)
    req.on_tokens(1, None)  # the first token has no inter-token latency
    req.on_tokens(4, 0.02)  # 4 tokens in 20 ms: 4 observations of 5 ms
    _, samples = parse(render_metrics(snapshot(), req))
    ttft_les = sorted(float(dict(labels)["le"]) for name, labels in samples
                      if name == "sglang:time_to_first_token_seconds_bucket" and dict(labels)["le"] != "+Inf")
    assert ttft_les == [float(b) for b in TTFT_BUCKETS_S]
    assert samples[key("sglang:time_to_first_token_seconds_bucket", le="0.2")] == 1
    assert samples[key("sglang:time_to_first_token_seconds_count")] == 2
    assert samples[key("sglang:inter_token_latency_seconds_count")] == 4
    assert samples[key("sglang:inter_token_latency_seconds_bucket", le="0.004")] == 0
    assert samples[key("sglang:inter_token_latency_seconds_bucket", le="0.006")] == 4
    assert samples[key("sglang:inter_token_latency_seconds_sum")] == pytest.approx(0.02)
    assert len([n for n, _ in samples if n == "sglang:inter_token_latency_seconds_bucket"]) == len(ITL_BUCKETS_S) + 1


def test_gen_throughput_counts_only_the_last_window():
    clock = FakeClock()
    req = RequestMetrics("m", clock=clock)
    req.on_tokens(30, None)
    clock.now += 1
    req.on_tokens(20, 1.0)
    assert req.gen_throughput() == 50 / THROUGHPUT_WINDOW_S
    clock.now += THROUGHPUT_WINDOW_S - 0.5  # the first batch is now older than the window
    assert req.gen_throughput() == 20 / THROUGHPUT_WINDOW_S
    clock.now += 1
    assert req.gen_throughput() == 0


def test_cache_hit_rate_and_bad_requests():
    req = RequestMetrics("m")
    assert req.cache_hit_rate() == 0.0
    req.on_finished(0.5, prompt_tokens=100, cached_tokens=25)
    req.on_finished(0.7, prompt_tokens=100, cached_tokens=75)
    req.on_bad_request()
    _, samples = parse(render_metrics(snapshot(), req))
    assert samples[key("sglang:cache_hit_rate")] == 0.5
    assert samples[key("sglang:e2e_request_latency_seconds_count")] == 2
    assert samples[key("sglang:e2e_request_latency_seconds_bucket", le="0.6")] == 1
    assert samples[key("sglang:num_bad_requests_total")] == 1


def test_storage_and_host_families_when_a_backend_reports():
    storage = {"pages_hit": 7, "pages_missed": 2, "pages_written": 9, "pages_skipped": 0, "failures": 1,
               "corruptions": 3, "bytes_read": 70, "bytes_written": 90, "prefetch_ops": 4, "backup_pages_failed": 2}
    snap = snapshot(storage)
    snap["host_transfers"] = {"pages_written": 11, "pages_loaded": 5, "failures": 0}
    _, samples = parse(render_metrics(snap, RequestMetrics("m")))
    assert samples[key("sglang:host_transfer_pages_total", direction="host_to_device")] == 5
    assert samples[key("sglang:host_transfer_pages_total", direction="device_to_host")] == 11
    assert samples[key("sglang:host_transfer_failures_total")] == 0
    assert samples[key("sglang:storage_prefetch_events_total", event="ops")] == 4
    assert samples[key("sglang:storage_backup_events_total", event="pages_failed")] == 2
    assert samples[key("sglang:storage_operations_total", op="pages_hit")] == 7
    assert samples[key("sglang:storage_failures_total", kind="corruptions")] == 3
    assert samples[key("sglang:storage_bytes_total", direction="written")] == 90


def test_each_server_has_its_own_registry():
    a, b = RequestMetrics("a"), RequestMetrics("b")
    a.on_bad_request()
    _, samples = parse(render_metrics(snapshot(), b))
    assert samples[("sglang:num_bad_requests_total", (("model_name", "b"),))] == 0
