"""L3 prefetch and backup on one rank, against the real file backend (through the ``dynamic``
ScriptedFileBackend where a slow or failing backend is needed).

Stop policies with a backend whose reads are slow or held (300 one-token pages = 3 chunks of
<= 128): best_effort returns what arrived when asked, wait_complete waits for all, timeout stops
on its budget while the read is still held. prefetch_threshold (asked and found); no capacity formula throttles prefetch. Backups
store only pages missing from L3, and cover a node split between its host write and the ack;
write_back backs up on eviction. A flush or an abort while reads are in flight returns every
slot; the integrity check counts reservations while they are held.
"""

import time

import pytest
from storage_test_backends import scripted_extra
from tree_fixtures import assert_kv, held_pages, make_hicache, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.storage_ops import PrefetchState
from sglang.srt.mem_cache.controller.storage_settings import StorageSettings
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")

T = [(7 * i + 3) % 5000 for i in range(300)]  # 300 pages of one token: chunks of 128, 128, 44
DEADLINE_S = 20


def cache(tmp_path, policy="wait_complete", page_size=1, write_policy="write_through", **extra):
    store = {"storage_backend": "dynamic", "model_name": "tiny",
             "storage_backend_extra_config": scripted_extra(tmp_path / "l3", **extra)}
    return make_hicache(page_size=page_size, device_pages=1024 // page_size, host_pages=1024 // page_size,
                        write_policy=write_policy, storage=store, prefetch_policy=policy)


def settle(h):
    h.cache_controller.synchronize()
    h.storage.synchronize()
    h.check_hicache_events()
    h.storage.synchronize()
    h.check_hicache_events()


def serve(h, tokens):
    r = start_request(h, tokens)
    h.cache_finished_req(r)
    return r


def l3(h):
    return h.cache_controller.get_stats()["l3"]


def wait_for(h, cond, what):
    """Drive the per-step agreement until ``cond()``; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        h.check_hicache_events()
        time.sleep(0.005)


def prefetch_and_wait(h, tokens, rid="r"):
    """Start a prefetch from the root and poll it to the end; (host hit, polls it took)."""
    assert h.prefetch_from_storage(rid, h.root_node, tokens) == len(tokens) // h.page_size * h.page_size
    polls = []
    wait_for(h, lambda: polls.append(1) or h.check_prefetch_progress(rid), "the prefetch to end")
    return h.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).host_hit_length, len(polls)


def filled(tmp_path, tokens=T, **kwargs):
    """A cache whose L3 holds ``tokens`` and whose L1 and L2 are empty."""
    h = cache(tmp_path, **kwargs)
    serve(h, tokens)
    settle(h)
    h.reset()
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).host_hit_length == 0
    return h


def test_wait_complete_waits_for_every_page_and_the_bytes_come_back(tmp_path):
    h = filled(tmp_path, policy="wait_complete", delay_get_s=0.2)
    hit, _ = prefetch_and_wait(h, T + [1])
    assert hit == 300  # all three slow reads were waited for (calls_get below)
    assert h.pop_prefetch_loaded_tokens("r") == 300 and h.pop_prefetch_loaded_tokens("r") == 0
    r = start_request(h, T + [1])
    assert r.loaded == 300
    assert_kv(h.token_to_kv_pool_allocator.get_kvcache(), r.kv_indices, T + [1])
    h.check_integrity(held_pages(h, [r]))
    h.cache_finished_req(r)
    stats = l3(h)
    assert (stats["calls_get"], stats["prefetch_pages_loaded"], stats["prefetch_timeouts"]) == (3, 300, 0)
    l2 = h.cache_controller.get_stats()["l2"]
    assert (l2["pages_written"], l2["pages_loaded"], l2["failures"]) == (300 + 1, 300, 0)  # fill + new page
    assert l2["bytes_loaded"] == 300 * h.cache_controller.mem_pool_host.get_size_per_token()
    h.reset()
    h.cache_controller.close()


def test_best_effort_returns_what_arrived_when_asked(tmp_path):
    """The first read returns, the second is held: asked then, best_effort stops with chunk one."""
    h = filled(tmp_path, policy="best_effort", hang_after={"get": 1})
    backend = h.cache_controller.storage_backend
    try:
        h.prefetch_from_storage("r", h.root_node, T)
        op = h.ongoing_prefetch["r"]
        wait_for(h, lambda: op.completed_pages >= 128, "the first chunk")
        assert backend.wait_hanging(DEADLINE_S)  # the second read is held
        assert h.check_prefetch_progress("r") is True  # asked now: stops with what is there
        hit = h.match_prefix(MatchPrefixParams(key=RadixKey(T))).host_hit_length
        assert hit == 128  # the whole chunk that arrived, not the 300 still coming
        h.check_integrity()  # the rest of the reservation is held until its read returns
    finally:
        backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()
    h.reset()
    assert h.cache_controller.mem_pool_host.available_size() == 1024
    h.cache_controller.close()


def test_timeout_stops_on_its_budget(tmp_path):
    """The read hangs until released (at most 60 s): the prefetch ends on its 0.3 s budget while
    the read is still held, and the late read returns its slots."""
    h = filled(tmp_path, policy="timeout", hang_on=["get"], prefetch_timeout_base=0.3,
               prefetch_timeout_per_ki_token=0.0)
    backend = h.cache_controller.storage_backend
    try:
        hit, _ = prefetch_and_wait(h, T)
        assert hit == 0 and l3(h)["prefetch_timeouts"] == 1
        assert backend.wait_hanging(0) and l3(h)["prefetch_pages_loaded"] == 0  # still held
    finally:
        backend.release_hangs()
    h.storage.synchronize()
    h.check_hicache_events()
    h.reset()
    assert h.cache_controller.mem_pool_host.available_size() == 1024
    h.cache_controller.close()


def test_timeout_budget_grows_with_the_hit_tokens():
    s = StorageSettings(prefetch_timeout_base=0.5, prefetch_timeout_per_ki_token=2.0, prefetch_timeout_max=3.0)
    assert s.timeout_budget(0) == 0.5
    assert s.timeout_budget(512) == 1.5
    assert s.timeout_budget(10_000) == 3.0  # capped


def test_prefetch_threshold_on_asked_and_on_found_tokens(tmp_path):
    h = filled(tmp_path, tokens=T[:100])  # L3 holds 100 pages
    assert h.prefetch_from_storage("short", h.root_node, T[:200]) == 0  # asked < 256: not started
    assert h.check_prefetch_progress("short") and "short" not in h.ongoing_prefetch
    hit, _ = prefetch_and_wait(h, T)  # asked 300 >= 256, found 100 < 256: nothing reserved
    assert hit == 0 and l3(h)["prefetch_pages_found"] == 100 and l3(h)["prefetch_skipped"] == 2
    assert h.cache_controller.mem_pool_host.available_size() == 1024
    h.cache_controller.close()
    low = filled(tmp_path / "low", tokens=T[:100], prefetch_threshold=64)
    hit, _ = prefetch_and_wait(low, T)
    assert hit == 100
    low.reset()
    low.cache_controller.close()


def test_backup_stores_only_pages_missing_from_l3(tmp_path):
    h = filled(tmp_path, tokens=T[:100])
    assert (l3(h)["backup_pages_submitted"], l3(h)["pages_written"]) == (100, 100)
    serve(h, T)  # found 100 < threshold: recomputed; the 300-token node is backed up
    settle(h)
    stats = l3(h)
    assert (stats["backup_pages_existing"], stats["backup_pages_submitted"], stats["pages_written"]) == (100, 300, 300)
    h.reset()
    hit, _ = prefetch_and_wait(h, T + [9])
    assert hit == 300
    serve(h, T + [9])  # the 300 pages came from L3 as host copies: only the new page goes back
    settle(h)
    stats = l3(h)
    assert (stats["backup_pages_existing"], stats["backup_pages_submitted"], stats["pages_written"]) == (100, 301, 301)
    node = h.match_prefix(MatchPrefixParams(key=RadixKey(T + [9]))).last_device_node
    assert h.write_backup_storage(node) == len(node.hash_value)  # an explicit backup: all there already
    settle(h)
    assert (l3(h)["backup_pages_existing"], l3(h)["pages_written"]) == (100 + len(node.hash_value), 301)
    h.reset()
    h.cache_controller.close()


def test_backup_covers_a_node_split_between_write_and_ack(tmp_path):
    h = cache(tmp_path, page_size=2)
    A = list(range(1, 13))
    r = start_request(h, A)
    h.cache_finished_req(r)  # host write queued, not acknowledged yet
    h.match_prefix(MatchPrefixParams(key=RadixKey(A[:4])))  # splits the node being written
    settle(h)
    assert l3(h)["backup_pages_submitted"] == 6
    h.reset()
    h.cache_controller.close()


def test_write_back_policy_backs_up_to_l3_on_eviction(tmp_path):
    h = cache(tmp_path, write_policy="write_back")
    serve(h, T)
    settle(h)
    assert l3(h)["backup_ops"] == 0  # not on host yet
    assert h.evict(EvictParams(num_tokens=300)).num_tokens_evicted == 300
    settle(h)
    assert l3(h)["pages_written"] == 300
    h.reset()
    hit, _ = prefetch_and_wait(h, T)
    assert hit == 300
    h.reset()
    h.cache_controller.close()


@pytest.mark.parametrize("end", ["flush", "abort"])
def test_flush_or_abort_with_reads_in_flight_returns_every_slot(tmp_path, end):
    h = filled(tmp_path, delay_get_s=0.5)
    host = h.cache_controller.mem_pool_host
    h.prefetch_from_storage("r", h.root_node, T)
    op = h.ongoing_prefetch["r"]
    wait_for(h, lambda: op.state is PrefetchState.LOADING, "the reads to start")
    assert sum(t.numel() for t in h.cache_controller.held_host_indices()) == 300
    h.check_integrity()  # reserved slots are held, not lost
    if end == "flush":
        h.reset()
    else:
        h.release_aborted_request("r")
        assert "r" not in h.ongoing_prefetch and h.check_prefetch_progress("r")
        h.storage.synchronize()
        h.check_hicache_events()  # the read returned: the reservation is freed
    assert host.available_size() == 1024 and h.cache_controller.held_host_indices() == []
    h.check_integrity()
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(T))).host_hit_length == 0
    h.cache_controller.close()


def test_prefetch_works_with_a_host_pool_smaller_than_the_device_pool(tmp_path):
    """No capacity formula throttles prefetch (upstream's 0.8 * (host - device) is <= 0 here)."""
    store = {"storage_backend": "file", "model_name": "tiny",
             "storage_backend_extra_config": {"storage_dir": str(tmp_path), "prefetch_threshold": 4}}
    h = make_hicache(page_size=2, device_pages=64, host_pages=24, storage=store, prefetch_policy="wait_complete")
    tokens = list(range(100, 141))
    serve(h, tokens)
    settle(h)
    h.reset()
    hit, _ = prefetch_and_wait(h, tokens)
    assert hit == 40
    h.reset()
    h.cache_controller.close()


def test_backend_faults_are_counted_misses(tmp_path):
    h = filled(tmp_path, raise_on=["get"])
    hit, _ = prefetch_and_wait(h, T)
    assert hit == 0 and l3(h)["failures"] == 1 and l3(h)["controller_failures"] == 1
    r = serve(h, T)  # still served (recomputed)
    assert r.loaded == 0
    h.reset()
    h.check_integrity()
    h.cache_controller.close()


def test_prefetch_arguments_are_checked(tmp_path):
    h = cache(tmp_path, page_size=2)
    r = serve(h, list(range(1, 9)))
    settle(h)  # its L3 backup (which pins it too) is done
    node = h.match_prefix(MatchPrefixParams(key=RadixKey(list(range(1, 9))))).last_device_node
    with pytest.raises(ValueError, match="last_hash is not the last page hash"):
        h.prefetch_from_storage("x", node, T, last_hash="0" * 64)
    with pytest.raises(ValueError, match="extra_key 'lora' differs"):
        h.prefetch_from_storage("x", node, T, extra_key="lora")
    assert h.prefetch_from_storage("x", node, T, last_hash=node.hash_value[-1]) == 300
    with pytest.raises(ValueError, match="already has a prefetch in flight"):
        h.prefetch_from_storage("x", node, T)
    assert node.host_ref_counter == 1  # pinned while the prefetch runs
    wait_for(h, lambda: h.check_prefetch_progress("x"), "the prefetch to end")
    assert node.host_ref_counter == 0
    assert r.loaded == 0
    h.reset()
    h.cache_controller.close()


def test_without_storage_the_l3_calls_are_no_ops():
    h = make_hicache(page_size=2)
    assert h.prefetch_from_storage("r", h.root_node, T) == 0 and h.check_prefetch_progress("r")
    h.release_aborted_request("r")
    assert h.cache_controller.get_stats()["l3"] == {} and h.cache_controller.storage_backend is None
    h.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
