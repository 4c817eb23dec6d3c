"""Upstream's HiCache metric names on /metrics, each moved by what it counts.

A real scheduler (tiny model, HiCache, file L3) serves a prompt, is flushed and serves it again
from L3 (and once more with host hits recomputed, so the fetched tokens go unused): the page it
renders (``render_metrics`` of a ``GET_STATS`` payload, what /metrics returns) has every
upstream name with upstream's type and labels, and the values agree with the figures they are
derived from (storage pages, host transfer pages, per-request tiers). Tree-level
cases (real HiRadixCache, the real file backend, scripted faults) move each reachable reason of
``storage_prefetch_unfulfilled_tokens_total``, the deferred counter, and the device->host
figures of write-backs (no ack) and of merged deferred writes (one duration per merged copy).
"""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.managers.cache_controller import L2Transfer, Tier
from sglang.srt.managers.io_struct import ControlKind, ControlReq
from sglang.srt.managers.scheduler_stats import SchedulerStats
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.transfer_lane import CpuEvent
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.srt.metrics.collector import RequestMetrics, render_metrics
from sglang.srt.metrics.hicache_metrics import BACKUP, CopyTiming, L2TransferMetrics
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=6, suite="per-commit-cpu")

UNIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(UNIT / "mem_cache"))
sys.path.insert(0, str(UNIT / "server"))
from scheduler_fixtures import drive, make_scheduler, prompts, request  # noqa: E402
from storage_test_backends import scripted_extra  # noqa: E402
from tree_fixtures import make_hicache, start_request  # noqa: E402

# family name (prometheus_client drops a counter's _total) -> (type, upstream's own label names)
RADIX = ("cache_type", "tp_rank", "pp_rank", "dp_rank")
STORAGE = ("storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")
UPSTREAM = {
    "sglang:prefetched_tokens": ("counter", STORAGE),
    "sglang:backuped_tokens": ("counter", STORAGE),
    "sglang:storage_prefetch_hit_tokens": ("counter", STORAGE),
    "sglang:storage_prefetch_unfulfilled_tokens": ("counter", STORAGE + ("reason",)),
    "sglang:storage_prefetch_deferred_tokens": ("counter", STORAGE + ("reason",)),
    "sglang:hicache_backup_duration_seconds": ("histogram", RADIX),
    "sglang:hicache_backup_bytes": ("counter", RADIX),
    "sglang:hicache_backup_tokens": ("counter", RADIX + ("pool",)),
    "sglang:load_back_duration_seconds": ("histogram", RADIX),
    "sglang:load_back_tokens": ("counter", RADIX + ("pool",)),
    "sglang:load_back_bytes": ("counter", RADIX),
    "sglang:hicache_host_used_tokens": ("gauge", ()),
    "sglang:hicache_host_total_tokens": ("gauge", ()),
    "sglang:cached_tokens": ("counter", ("cache_source",)),
}
DEADLINE_S = 20


class Page:
    """A parsed /metrics page: family types and label names, and sample lookups."""

    def __init__(self, text: str):
        self.types, self.labels, self.samples = {}, {}, []
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            self.labels[fam.name] = {k for s in fam.samples for k in s.labels}
            self.samples += [(s.name, s.labels, s.value) for s in fam.samples]

    def value(self, name: str, **labels) -> float:
        """The one sample named ``name`` whose labels include ``labels``."""
        found = [v for n, ls, v in self.samples if n == name and labels.items() <= ls.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]


def scrape_scheduler(sched) -> Page:
    payload = sched.handle_messages([ControlReq(1, ControlKind.GET_STATS)])[0].payload
    return Page(render_metrics(payload, RequestMetrics("tiny")))


def scrape_tree(h) -> Page:
    """What /metrics shows for a scheduler around tree ``h`` (idle, nothing queued)."""
    alloc = h.token_to_kv_pool_allocator
    runner = SimpleNamespace(token_to_kv_pool_allocator=alloc, max_total_num_tokens=alloc.get_kvcache().size)
    shell = SimpleNamespace(tree_cache=h, runner=runner, running=[], waiting=[], chunked_req=None)
    return Page(render_metrics(SchedulerStats().snapshot(shell), RequestMetrics("m")))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def test_every_upstream_name_on_the_page_moved_by_a_served_l3_round_trip(model, tmp_path):
    extra = {"storage_dir": str(tmp_path / "l3"), "prefetch_threshold": 4}
    sched = make_scheduler(model, page_size=4, enable_hierarchical_cache=True, hicache_storage_backend="file",
                           hicache_storage_backend_extra_config=json.dumps(extra),
                           hicache_storage_prefetch_policy="wait_complete")
    try:
        prompt = prompts(1, 24)[0]
        drive(sched, {0: [request("a", prompt, max_new=4)]})
        assert sched.flush_cache().ok  # waits for the host writes and their L3 backups
        second = drive(sched, {0: [request("b", prompt, max_new=4)]})["b"].cached
        page = scrape_scheduler(sched)
        # fetched from L3 into host, then not reused at admission: host hits are recomputed now
        sched.tree_cache.load_back_threshold = 1 << 20
        assert sched.flush_cache().ok
        third = drive(sched, {0: [request("c", prompt, max_new=4)]})["c"].cached
        again = scrape_scheduler(sched)
    finally:
        sched.shutdown()
    for name, (kind, labels) in UPSTREAM.items():
        assert page.types.get(name) == kind, name
        assert set(labels) <= page.labels[name], (name, page.labels[name])
    storage = {"storage_backend": "file", "tp_rank": "0", "pp_size": "1"}
    hit = page.value("sglang:storage_prefetch_hit_tokens_total", **storage)
    prefetched = page.value("sglang:prefetched_tokens_total", **storage)
    assert second["storage"] > 0 and hit == prefetched >= second["storage"]
    shortfall = page.value("sglang:storage_prefetch_unfulfilled_tokens_total", reason="cache_admission_shortfall")
    assert prefetched == second["storage"] + shortfall  # every fetched token reused or accounted
    for tier in ("device", "host", "storage"):  # one series per tier, both labels naming it
        assert page.value("sglang:cached_tokens_total", cache_source=tier) == \
            page.value("sglang:cached_tokens_total", tier=tier)
    assert page.value("sglang:cached_tokens_total", cache_source="storage") == second["storage"]
    assert page.value("sglang:backuped_tokens_total") == 4 * page.value("sglang:storage_operations_total",
                                                                        op="pages_written") > 0
    radix = {"cache_type": "HiRadixCache", "tp_rank": "0", "dp_rank": "0"}
    for name, direction in (("hicache_backup", "device_to_host"), ("load_back", "host_to_device")):
        pages = page.value("sglang:host_transfer_pages_total", direction=direction)
        assert pages > 0 and page.value(f"sglang:{name}_tokens_total", pool="kv", **radix) == 4 * pages
        assert page.value(f"sglang:{name}_bytes_total", **radix) > 0
        assert page.value(f"sglang:{name}_duration_seconds_count", **radix) >= 1
        assert page.value(f"sglang:{name}_duration_seconds_sum", **radix) > 0
    reason = "cache_admission_shortfall"
    fetched = again.value("sglang:prefetched_tokens_total") - prefetched
    assert third["storage"] == 0 and fetched == prefetched
    assert again.value("sglang:storage_prefetch_unfulfilled_tokens_total", reason=reason) == shortfall + fetched
    total = page.value("sglang:hicache_host_total_tokens")
    assert total == page.value("sglang:cache_pool_capacity_tokens", tier="host") > 0
    assert 0 < page.value("sglang:hicache_host_used_tokens") == page.value("sglang:cache_pool_used_tokens",
                                                                            tier="host")


# ---- tree level: the reasons a found L3 prefix does not become a usable prefetch ------------
A = [(5 * i + 2) % 3000 for i in range(64)]  # 64 one-token pages


def filled(tmp_path, host_pages=256, policy="wait_complete", **script):
    """A cache over L3 holding ``A`` (written by a first cache on the same directory), L1/L2 empty."""
    writer = make_hicache(device_pages=256, host_pages=256, storage=store(tmp_path))
    start = start_request(writer, A)
    writer.cache_finished_req(start)
    writer.reset()  # drains the host write and its L3 backup
    writer.cache_controller.close()
    return make_hicache(device_pages=256, host_pages=host_pages, storage=store(tmp_path, **script),
                        prefetch_policy=policy)


def store(tmp_path, **script) -> dict:
    return {"storage_backend": "dynamic", "model_name": "tiny",
            "storage_backend_extra_config": scripted_extra(tmp_path / "l3", prefetch_threshold=16, **script)}


def poll(h, rid="r", tokens=A) -> None:
    """Prefetch ``tokens`` for ``rid`` from the root and poll it to its end."""
    assert h.prefetch_from_storage(rid, h.root_node, tokens) > 0
    deadline = time.monotonic() + DEADLINE_S
    while not h.check_prefetch_progress(rid):
        assert time.monotonic() < deadline, "the prefetch did not end"
        h.check_hicache_events()
        time.sleep(0.002)


def unfulfilled(h) -> dict[str, float]:
    page = scrape_tree(h)
    return {ls["reason"]: v for n, ls, v in page.samples
            if n == "sglang:storage_prefetch_unfulfilled_tokens_total" and v}


def close(h, backend=None) -> None:
    if backend is not None:
        backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()
    h.reset()
    h.cache_controller.close()


def test_below_threshold_and_host_capacity(tmp_path):
    h = filled(tmp_path, host_pages=32)  # 64 found pages cannot be reserved in 32 host slots
    poll(h)
    page = scrape_tree(h)
    assert page.value("sglang:storage_prefetch_hit_tokens_total") == 64
    assert unfulfilled(h) == {"host_capacity": 64}
    assert page.value("sglang:storage_prefetch_deferred_tokens_total", reason="host_capacity") == 64
    assert page.value("sglang:storage_prefetch_deferred_tokens_total", reason="device_capacity") == 0
    assert page.value("sglang:prefetched_tokens_total") == 0
    poll(h, "s", A[:8] + [9999] * 24)  # L3 has the first 8 pages only: below the 16-token threshold
    assert unfulfilled(h) == {"host_capacity": 64, "below_threshold": 8}
    close(h)


@pytest.mark.parametrize("script,policy,reason", [
    ({"hang_on": ["get"], "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0}, "timeout",
     "deadline"),
    ({"raise_on": ["get"]}, "wait_complete", "storage_transfer"),
])
def test_read_that_stops_short(tmp_path, script, policy, reason):
    h = filled(tmp_path, policy=policy, **script)
    poll(h)
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(A))).host_hit_length == 0
    assert unfulfilled(h) == {reason: 64}
    close(h, h.cache_controller.storage_backend)


def test_abort_during_the_read_drops_the_hit_and_a_read_in_full_counts_as_prefetched(tmp_path):
    h = filled(tmp_path, hang_on=["get"])
    backend = h.cache_controller.storage_backend
    assert h.prefetch_from_storage("r", h.root_node, A) == 64
    deadline = time.monotonic() + DEADLINE_S
    while not backend.wait_hanging(0.01):
        assert time.monotonic() < deadline, "the read never started"
        h.check_hicache_events()
    h.release_aborted_request("r")
    assert unfulfilled(h) == {"dropped": 64}
    close(h, backend)
    h = filled(tmp_path)
    poll(h)
    page = scrape_tree(h)
    assert page.value("sglang:prefetched_tokens_total") == page.value("sglang:storage_prefetch_hit_tokens_total") == 64
    h.count_prefetch_admission_shortfall(4)  # what admission reports (schedule_policy)
    assert unfulfilled(h) == {"cache_admission_shortfall": 4}
    close(h)


# ---- device <-> host copies -----------------------------------------------------------------
def test_write_backs_without_acks_are_counted_when_done():
    h = make_hicache(device_pages=64, host_pages=128, write_policy="write_back")
    h.cache_finished_req(start_request(h, A))
    assert scrape_tree(h).value("sglang:hicache_backup_tokens_total", pool="kv") == 0  # not on host yet
    assert h.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 64  # written back, then freed
    page = scrape_tree(h)
    assert page.value("sglang:hicache_backup_tokens_total", pool="kv") == 64
    assert page.value("sglang:hicache_backup_bytes_total") == 64 * h.cache_controller.mem_pool_host.get_size_per_token()
    assert page.value("sglang:hicache_backup_duration_seconds_count") == 1
    h.reset()
    h.cache_controller.close()


def test_merged_deferred_writes_time_one_copy_and_count_every_slot():
    h = make_hicache(device_pages=32, host_pages=32)
    ctl = h.cache_controller
    ctl.defer_writes = True
    for node_id in (1, 2):
        ctl.write([L2Transfer(PoolName.KV, ctl.alloc(Tier.HOST, PoolName.KV, 4),
                              ctl.alloc(Tier.DEVICE, PoolName.KV, 4))], [node_id])
    assert scrape_tree(h).value("sglang:hicache_backup_tokens_total", pool="kv") == 0  # queued, not run
    assert ctl.start_writing() == 2
    ctl.synchronize_writes()
    page = scrape_tree(h)
    assert page.value("sglang:hicache_backup_tokens_total", pool="kv") == 8
    assert page.value("sglang:hicache_backup_duration_seconds_count") == 1  # one merged copy
    assert page.value("sglang:load_back_duration_seconds_count") == 0
    ctl.close()


def test_a_failed_copy_is_not_counted_and_does_not_block_later_ones():
    metrics = L2TransferMetrics()
    failed, ok = CpuEvent(armed=True), CpuEvent(armed=True)
    timing = CopyTiming()
    metrics.submitted(BACKUP, failed, CopyTiming(), {"kv": 4}, 400)
    metrics.submitted(BACKUP, ok, timing, {"kv": 2}, 200)
    timing.start()
    timing.stop()
    ok.record()
    assert metrics.snapshot()[BACKUP]["bytes"] == 0  # the first copy is not done: nothing after it counts
    failed.fail(RuntimeError("copy failed"))
    backup = metrics.snapshot()[BACKUP]
    assert (backup["tokens_by_pool"], backup["bytes"], sum(backup["duration_seconds"]["counts"])) == ({"kv": 2}, 200, 1)
