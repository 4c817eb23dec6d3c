"""The /metrics page through ``prometheus_client``: the HTTP process's request metrics in a
private ``CollectorRegistry`` per server, and the scheduler's snapshot
(``SchedulerStats.snapshot``) exposed as metric families at scrape time.

Names follow upstream sglang where upstream has the metric (``sglang:`` prefix, label
``model_name``, upstream's histogram buckets); ours add the cache tiers, host transfers and the
storage backend's counters. Units: tokens unless the name says otherwise.

Upstream's HiCache families (``_hicache_families``, from the snapshot's ``hicache`` section) carry
upstream's names, types and label names: the radix cache labels (``cache_type``, ``tp_rank``,
``pp_rank``, ``dp_rank``) on the device<->host figures, the storage labels (``storage_backend``,
ranks and sizes) on the L3 ones, ``pool`` / ``reason`` / ``cache_source`` where upstream has them;
``model_name`` is on every family here. ``sglang:cached_tokens_total`` is one family with both
labels, ``tier`` (ours) and ``cache_source`` (upstream's), equal on each series.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["CONTENT_TYPE_LATEST", "RequestMetrics", "render_metrics"]

# upstream's TokenizerMetricsCollector buckets (seconds)
TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS_S = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
E2E_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
THROUGHPUT_WINDOW_S = 10.0
LABELS = ["model_name"]


class RequestMetrics:
    """What the HTTP process measures per request. Thread-safe; ``clock`` returns seconds."""

    def __init__(self, model_name: str = "", clock=time.monotonic):
        self.model_name, self.clock = model_name, clock
        self.registry = CollectorRegistry()
        reg, name = self.registry, [model_name]
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
            registry=reg, buckets=TTFT_BUCKETS_S).labels(*name)
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
            registry=reg, buckets=ITL_BUCKETS_S).labels(*name)
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", LABELS,
            registry=reg, buckets=E2E_BUCKETS_S).labels(*name)
        self.bad_requests = Counter("sglang:num_bad_requests", "Requests rejected with HTTP 4xx.", LABELS,
                                    registry=reg).labels(*name)
        self.num_requests_received = 0
        self._lock = threading.Lock()
        self._token_times: deque[tuple[float, int]] = deque()  # (arrival, tokens), last window only
        self._prompt_tokens = 0  # of finished requests, for cache_hit_rate
        self._cached_tokens = 0

    def on_bad_request(self) -> None:
        self.bad_requests.inc()

    def on_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def on_tokens(self, num_tokens: int, interval_s: float | None) -> None:
        """``num_tokens`` arrived ``interval_s`` after the previous ones (None: the first)."""
        if interval_s is not None and num_tokens > 0:
            for _ in range(num_tokens):  # each token waited its share of the interval
                self.inter_token_latency.observe(interval_s / num_tokens)
        with self._lock:
            self._token_times.append((self.clock(), num_tokens))
            self._trim()

    def on_finished(self, e2e_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.e2e_request_latency.observe(e2e_s)
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += cached_tokens

    def _trim(self) -> None:
        horizon = self.clock() - THROUGHPUT_WINDOW_S
        while self._token_times and self._token_times[0][0] < horizon:
            self._token_times.popleft()

    def gen_throughput(self) -> float:
        """Output tokens per second over the last ``THROUGHPUT_WINDOW_S`` seconds."""
        with self._lock:
            self._trim()
            return sum(n for _, n in self._token_times) / THROUGHPUT_WINDOW_S

    def cache_hit_rate(self) -> float:
        """Prompt tokens reused from a cache tier / prompt tokens, over finished requests."""
        with self._lock:
            return self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0


class _Families:
    """Builds metric families carrying the ``model_name`` label."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.out: list = []

    def add(self, kind, name: str, help: str, samples: list[tuple[dict, float]]) -> None:
        extra = sorted({k for labels, _ in samples for k in labels})
        family = kind(name, help, labels=LABELS + extra)
        for labels, value in samples:
            family.add_metric([self.model_name] + [str(labels[k]) for k in extra], value)
        self.out.append(family)

    def counter(self, name: str, help: str, samples) -> None:
        self.add(CounterMetricFamily, name, help, samples)

    def gauge(self, name: str, help: str, samples) -> None:
        self.add(GaugeMetricFamily, name, help, samples)

    def histogram(self, name: str, help: str, labels: dict, hist: dict) -> None:
        """One series from a ``DurationHistogram.snapshot()`` (per-bucket counts, +Inf last)."""
        extra = sorted(labels)
        family = HistogramMetricFamily(name, help, labels=LABELS + extra)
        cumulative, buckets = 0, []
        for bound, n in zip([*map(floatToGoString, hist["buckets"]), "+Inf"], hist["counts"]):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric([self.model_name] + [str(labels[k]) for k in extra], buckets, hist["sum"])
        self.out.append(family)


def _snapshot_families(snapshot: dict, requests: RequestMetrics) -> list:
    f, c, pools = _Families(requests.model_name), snapshot["counters"], snapshot["pools"]
    f.counter("sglang:prompt_tokens", "Number of prefill tokens processed (finished requests).",
              [({}, c["prompt_tokens"])])
    f.counter("sglang:generation_tokens", "Number of generation tokens processed (finished requests).",
              [({}, c["generation_tokens"])])
    f.counter("sglang:cached_tokens", "Prompt tokens served from a cache tier instead of computed, counted at "
              "admission; tier and cache_source (upstream's label) both name the tier.",
              [({"tier": t, "cache_source": t}, n) for t, n in c["cached_tokens"].items()])
    f.counter("sglang:num_requests", "Requests finished by the scheduler.", [({}, c["num_requests"])])
    f.counter("sglang:num_aborted_requests", "Requests aborted (client gone or refused).", [({}, c["num_aborted"])])
    f.gauge("sglang:num_running_reqs", "The number of running requests.", [({}, snapshot["num_running_reqs"])])
    f.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
            [({}, snapshot["num_waiting_reqs"])])
    f.gauge("sglang:num_waiting_reqs", "Requests waiting for admission (same as num_queue_reqs).",
            [({}, snapshot["num_waiting_reqs"])])
    device = pools["device"]
    f.gauge("sglang:num_used_tokens", "Device KV slots in use.", [({}, device["used_tokens"])])
    f.gauge("sglang:token_usage", "Device KV slots in use / device KV slots.",
            [({}, device["used_tokens"] / device["capacity_tokens"] if device["capacity_tokens"] else 0.0)])
    f.gauge("sglang:gen_throughput", "The generation throughput (token/s) over the last 10 s.",
            [({}, requests.gen_throughput())])
    f.gauge("sglang:cache_hit_rate", "The prefix cache hit rate (cached / prompt tokens of finished requests).",
            [({}, requests.cache_hit_rate())])
    f.gauge("sglang:cache_pool_capacity_tokens", "Token slots of each cache tier's pool.",
            [({"tier": t}, p["capacity_tokens"]) for t, p in pools.items()])
    f.gauge("sglang:cache_pool_used_tokens", "Token slots in use (cached prefixes and running requests).",
            [({"tier": t}, p["used_tokens"]) for t, p in pools.items()])
    _tier_families(f, snapshot)
    _hicache_families(f, snapshot)
    _mamba_families(f, snapshot.get("mamba"))
    return f.out


def _mamba_families(f: _Families, mamba: dict | None) -> None:
    """Upstream's state pool gauges (state models only), in slots; ``mamba_evictable_tokens`` are
    the prefix cache's checkpoints."""
    if mamba is None:
        return
    used = mamba["capacity_slots"] - mamba["free_slots"]
    f.gauge("sglang:mamba_usage", "State slots in use / state slots (running requests and checkpoints).",
            [({}, used / mamba["capacity_slots"] if mamba["capacity_slots"] else 0.0)])
    f.gauge("sglang:mamba_available_tokens", "Free state slots of the device Mamba pool.",
            [({}, mamba["free_slots"])])
    f.gauge("sglang:mamba_evictable_tokens", "State slots the prefix cache holds (checkpoints where prefixes "
            "end; evicted LRU when requests need slots).", [({}, mamba["checkpoint_slots"])])
    f.gauge("sglang:mamba_used_tokens", "State slots running requests hold (their own and pending checkpoints).",
            [({}, mamba["running_slots"])])
    f.counter("sglang:mamba_checkpoints_skipped", "Checkpoints not taken: no state slot free or evictable.",
              [({}, mamba["checkpoints_skipped"])])
    if "host_capacity_slots" in mamba:
        f.gauge("sglang:hicache_host_mamba_used_states", "State slots in use in the host Mamba pool.",
                [({}, mamba["host_used_slots"])])
        f.gauge("sglang:hicache_host_mamba_total_states", "State slots of the host Mamba pool.",
                [({}, mamba["host_capacity_slots"])])


def _hicache_families(f: _Families, snapshot: dict) -> None:
    """Upstream's HiCache metric names (present with HiCache; the L3 ones with a backend)."""
    host = snapshot["pools"].get("host")
    if host is not None:
        f.gauge("sglang:hicache_host_used_tokens", "Host KV pool token slots in use.", [({}, host["used_tokens"])])
        f.gauge("sglang:hicache_host_total_tokens", "Host KV pool token slots.", [({}, host["capacity_tokens"])])
    hicache = snapshot.get("hicache") or {}
    if "l2" in hicache:
        labels, l2 = hicache["labels"], hicache["l2"]
        for direction, prefix, what in (("backup", "sglang:hicache_backup", "device to host"),
                                        ("load_back", "sglang:load_back", "host to device")):
            d = l2[direction]
            f.histogram(f"{prefix}_duration_seconds", f"Seconds one merged {what} copy took, measured where it "
                        "ran (copy loop on a worker lane, GPU stream span on CUDA).", labels, d["duration_seconds"])
            f.counter(f"{prefix}_bytes_total", f"Bytes copied {what}, every pool of a copy, counted once done.",
                      [(labels, d["bytes"])])
            f.counter(f"{prefix}_tokens_total", f"Slots copied {what} per host pool, counted once done.",
                      [({**labels, "pool": p}, n) for p, n in d["tokens_by_pool"].items()])
    storage = hicache.get("storage")
    if storage is None:
        return
    labels = storage["labels"]
    f.counter("sglang:prefetched_tokens_total", "Tokens an L3 prefetch brought into host memory (agreed over "
              "ranks), duplicates the tree had meanwhile included.", [(labels, storage["prefetched_tokens"])])
    f.counter("sglang:backuped_tokens_total", "Tokens written from host memory to L3 (pages L3 already held "
              "are not written again, not counted).", [(labels, storage["backuped_tokens"])])
    f.counter("sglang:storage_prefetch_hit_tokens_total", "Tokens an L3 existence check found (agreed over "
              "ranks), before host slots were reserved.", [(labels, storage["hit_tokens"])])
    f.counter("sglang:storage_prefetch_unfulfilled_tokens_total", "Found L3 tokens that did not become a "
              "usable prefetch, by reason (docs/server.md, Metrics).",
              [({**labels, "reason": r}, n) for r, n in storage["unfulfilled_tokens"].items()])
    f.counter("sglang:storage_prefetch_deferred_tokens_total", "Found L3 tokens left for a later retry, by "
              "capacity reason.", [({**labels, "reason": r}, n) for r, n in storage["deferred_tokens"].items()])


def _tier_families(f: _Families, snapshot: dict) -> None:
    host = snapshot.get("host_transfers") or {}
    if host:
        f.counter("sglang:host_transfer_pages", "Pages copied between device and host pools.",
                  [({"direction": "device_to_host"}, host.get("pages_written", 0)),
                   ({"direction": "host_to_device"}, host.get("pages_loaded", 0))])
        f.counter("sglang:host_transfer_failures", "Failed device<->host copies.", [({}, host.get("failures", 0))])
    storage = snapshot.get("storage") or {}
    if not storage:
        return
    f.counter("sglang:storage_operations", "L3 storage page operations by outcome.",
              [({"op": op}, storage.get(op, 0)) for op in ("pages_hit", "pages_missed", "pages_written",
                                                            "pages_skipped")])
    f.counter("sglang:storage_failures", "L3 storage backend faults (I/O errors, corruptions).",
              [({"kind": k}, storage.get(k, 0)) for k in ("failures", "corruptions")])
    f.counter("sglang:storage_bytes", "L3 payload bytes moved.",
              [({"direction": "read"}, storage.get("bytes_read", 0)),
               ({"direction": "written"}, storage.get("bytes_written", 0))])
    for kind in ("prefetch", "backup"):
        events = sorted(k for k in storage if k.startswith(kind + "_") and "_tokens_" not in k)
        f.counter(f"sglang:storage_{kind}_events", f"L3 {kind} events of the HiCache controller.",
                  [({"event": k[len(kind) + 1:]}, storage[k]) for k in events])


class _Scrape:
    """One scrape: the HTTP registry plus the scheduler's snapshot (``generate_latest`` input)."""

    def __init__(self, requests: RequestMetrics, snapshot: dict):
        self.requests, self.snapshot = requests, snapshot

    def collect(self):
        yield from self.requests.registry.collect()
        yield from _snapshot_families(self.snapshot, self.requests)


def render_metrics(snapshot: dict, requests: RequestMetrics) -> str:
    """The /metrics page (Prometheus text format, ``CONTENT_TYPE_LATEST``)."""
    return generate_latest(_Scrape(requests, snapshot)).decode()
