"""Prometheus text exposition: a histogram type, the HTTP side's request metrics, and the
renderer that merges them with the scheduler's snapshot (``SchedulerStats.snapshot``).

Names follow upstream sglang (``sglang:`` prefix, ``_total`` counters, ``_seconds``
histograms). Units: tokens unless the name says otherwise.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative-bucket histogram (``le`` upper bounds in seconds), thread-safe."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        with self._lock:
            for le, n in zip([*map(_fmt, self.buckets), "+Inf"], self.counts):
                running += n
                out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
            out.append(f"{name}_sum{{{labels}}} {_fmt(self.sum)}")
            out.append(f"{name}_count{{{labels}}} {running}")
        return out


class RequestMetrics:
    """What the HTTP process measures per request."""

    def __init__(self):
        self.time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self.e2e_request_latency = Histogram(E2E_BUCKETS_S)
        self.num_requests_received = 0
        self.num_bad_requests = 0


def _fmt(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Writer:
    def __init__(self, base_labels: str):
        self.base = base_labels
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help: str, samples: list[tuple[dict, float]]) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            extra = "".join(f',{k}="{v}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{self.base}{extra}}} {_fmt(value)}")

    def histogram(self, name: str, help: str, hist: Histogram) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        self.lines += hist.lines(name, self.base)


def render_metrics(snapshot: dict, requests: RequestMetrics, model_name: str) -> str:
    """The /metrics page: scheduler counters and pools from ``snapshot``, HTTP histograms."""
    w = _Writer(f'model_name="{model_name}"')
    c = snapshot["counters"]
    w.metric("sglang:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, c["prompt_tokens"])])
    w.metric("sglang:generation_tokens_total", "counter", "Generated tokens of finished requests.",
             [({}, c["generation_tokens"])])
    w.metric("sglang:cached_tokens_total", "counter", "Prompt tokens served from a cache tier instead of computed.",
             [({"tier": t}, n) for t, n in c["cached_tokens"].items()])
    w.metric("sglang:num_requests_total", "counter", "Requests finished by the scheduler.", [({}, c["num_requests"])])
    w.metric("sglang:num_aborted_requests_total", "counter", "Requests aborted (client gone or refused).",
             [({}, c["num_aborted"])])
    w.metric("sglang:num_bad_requests_total", "counter", "Requests rejected with HTTP 4xx.",
             [({}, requests.num_bad_requests)])
    w.metric("sglang:num_running_reqs", "gauge", "Requests being prefilled or decoded.",
             [({}, snapshot["num_running_reqs"])])
    w.metric("sglang:num_waiting_reqs", "gauge", "Requests waiting for admission.",
             [({}, snapshot["num_waiting_reqs"])])
    pools = snapshot["pools"]
    w.metric("sglang:cache_pool_capacity_tokens", "gauge", "Token slots of each cache tier's pool.",
             [({"tier": t}, p["capacity_tokens"]) for t, p in pools.items()])
    w.metric("sglang:cache_pool_used_tokens", "gauge", "Token slots in use (cached prefixes and running requests).",
             [({"tier": t}, p["used_tokens"]) for t, p in pools.items()])
    host_ops = snapshot.get("host_transfers") or {}
    if host_ops:
        w.metric("sglang:host_transfer_pages_total", "counter", "Pages copied between device and host pools.",
                 [({"direction": "device_to_host"}, host_ops.get("pages_written", 0)),
                  ({"direction": "host_to_device"}, host_ops.get("pages_loaded", 0))])
        w.metric("sglang:host_transfer_failures_total", "counter", "Failed device<->host copies.",
                 [({}, host_ops.get("failures", 0))])
    storage = snapshot.get("storage") or {}
    if storage:
        w.metric("sglang:storage_operations_total", "counter", "L3 storage page operations by outcome.",
                 [({"op": op}, storage.get(op, 0)) for op in ("pages_hit", "pages_missed", "pages_written",
                                                               "pages_skipped")])
        w.metric("sglang:storage_failures_total", "counter", "L3 storage backend faults (I/O errors, corruptions).",
                 [({"kind": k}, storage.get(k, 0)) for k in ("failures", "corruptions")])
        w.metric("sglang:storage_bytes_total", "counter", "L3 payload bytes moved.",
                 [({"direction": "read"}, storage.get("bytes_read", 0)),
                  ({"direction": "written"}, storage.get("bytes_written", 0))])
        for kind in ("prefetch", "backup"):
            events = sorted(k for k in storage if k.startswith(kind + "_"))
            w.metric(f"sglang:storage_{kind}_events_total", "counter", f"L3 {kind} events of the HiCache controller.",
                     [({"event": k[len(kind) + 1:]}, storage[k]) for k in events])
    w.histogram("sglang:time_to_first_token_seconds", "Time from request arrival to its first output token.",
                requests.time_to_first_token)
    w.histogram("sglang:e2e_request_latency_seconds", "Time from request arrival to its last output token.",
                requests.e2e_request_latency)
    return "\n".join(w.lines) + "\n"
