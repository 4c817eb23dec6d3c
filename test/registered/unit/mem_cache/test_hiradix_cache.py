"""HiRadixCache storylines: each write policy with exact slots, device -> host -> device with
the bytes checked, host eviction order, refusals, bad input and the leak check."""

import pytest
from tree_fixtures import assert_kv, held_pages, make_hicache, start_request

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

A = [1, 2, 3, 4, 5, 6]


def settle(h):
    """Let every transfer finish and consume the acks (what the scheduler loop does)."""
    h.cache_controller.synchronize()
    h.check_hicache_events()


def run(h, tokens, extra_key=None, load_back=True):
    r = start_request(h, tokens, extra_key, load_back)
    assert r is not None
    h.check_integrity(held_pages(h, [r]))
    h.cache_finished_req(r)
    return r


def sizes(h):
    host = h.cache_controller.mem_pool_host
    return h.token_to_kv_pool_allocator.available_size(), host.available_size()


def test_write_through_device_host_device_with_bytes():
    h = make_hicache(page_size=2, device_pages=4, host_pages=8, write_policy="write_through")
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    r = run(h, A)
    assert r.kv_indices.tolist() == [2, 3, 4, 5, 6, 7]
    node = h.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_device_node
    assert node.host_value.tolist() == [0, 1, 2, 3, 4, 5]
    assert node.lock_ref == 1 and h.protected_size() == 6  # locked until the write is acked
    settle(h)
    assert node.lock_ref == 0 and h.evictable_size() == 6
    assert h.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6 and node.evicted and sizes(h) == (8, 10)
    pool.buffers["k"].zero_()
    pool.buffers["v"].zero_()
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(A + [7, 8])))
    assert (m.device_indices.numel(), m.host_hit_length, m.last_host_node) == (0, 6, node)
    assert m.last_device_node is h.root_node
    r2 = start_request(h, A + [7, 8])
    assert r2.loaded == 6 and r2.kv_indices.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert_kv(pool, r2.kv_indices, A + [7, 8])
    h.check_integrity(held_pages(h, [r2]))
    h.cache_finished_req(r2)
    settle(h)
    h.check_integrity()
    h.reset()
    assert sizes(h) == (8, 16)


def test_write_through_selective_backs_up_on_the_second_hit():
    h = make_hicache(page_size=2, device_pages=6, host_pages=8, write_policy="write_through_selective")
    run(h, A)
    settle(h)
    node = h.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_device_node
    assert not node.backuped and sizes(h)[1] == 16
    run(h, A + [7, 8])
    settle(h)
    assert node.host_value.tolist() == [0, 1, 2, 3, 4, 5]
    leaf = h.match_prefix(MatchPrefixParams(key=RadixKey(A + [7, 8]))).last_device_node
    assert leaf is not node and not leaf.backuped
    # [7, 8] has no host copy: dropped; A keeps its host copy
    assert h.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 8
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(A + [7, 8])))
    assert (m.host_hit_length, m.last_host_node) == (6, node)
    h.check_integrity()


def test_write_back_backs_up_only_when_evicting():
    h = make_hicache(page_size=2, device_pages=4, host_pages=8, write_policy="write_back")
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    run(h, A)
    settle(h)
    node = h.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_device_node
    assert not node.backuped and sizes(h) == (2, 16)
    assert h.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 6  # the whole leaf goes, backed up first
    assert node.evicted and node.host_value.tolist() == [0, 1, 2, 3, 4, 5] and sizes(h) == (8, 10)
    pool.buffers["k"].zero_()
    r = start_request(h, A)
    assert r.loaded == 6
    assert_kv(pool, r.kv_indices, A)
    h.cache_finished_req(r)
    settle(h)
    h.check_integrity()


def test_evict_host_drops_least_recent_host_only_leaves_first():
    h = make_hicache(page_size=2, device_pages=8, host_pages=8)
    run(h, [1, 2, 3, 4])
    run(h, [5, 6, 7, 8])
    settle(h)
    h.match_prefix(MatchPrefixParams(key=RadixKey([5, 6, 7, 8])))  # [5..8] is now the more recent
    assert h.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 8 and sizes(h) == (16, 8)
    assert h.evict_host(2) == 4
    assert h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).host_hit_length == 0
    assert h.match_prefix(MatchPrefixParams(key=RadixKey([5, 6, 7, 8]))).host_hit_length == 4
    assert h.evict_host(100) == 4 and sizes(h) == (16, 16)
    assert not h.root_node.children
    h.check_integrity()


def test_full_host_refuses_backup_then_host_eviction_makes_room():
    h = make_hicache(page_size=2, device_pages=8, host_pages=3)
    run(h, A)
    settle(h)
    first = h.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_device_node
    run(h, [9, 9])  # host has no room left: the backup is refused, nothing is locked
    settle(h)
    second = h.match_prefix(MatchPrefixParams(key=RadixKey([9, 9]))).last_device_node
    assert first.backuped and not second.backuped and second.lock_ref == 0
    h.evict(EvictParams(num_tokens=100))
    gone = h.match_prefix(MatchPrefixParams(key=RadixKey([9, 9])))
    assert gone.device_indices.numel() == 0 and gone.host_hit_length == 0
    run(h, [7, 7, 7, 7])  # needs 4 host slots: the host-only A is evicted to make room
    settle(h)
    assert h.match_prefix(MatchPrefixParams(key=RadixKey(A))).host_hit_length == 0
    node = h.match_prefix(MatchPrefixParams(key=RadixKey([7, 7, 7, 7]))).last_device_node
    assert node.host_value.tolist() == [0, 1, 2, 3]
    h.check_integrity()


def test_recompute_refills_an_evicted_node():
    h = make_hicache(page_size=2, device_pages=8, host_pages=8)
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    run(h, [1, 2, 3, 4])
    settle(h)
    h.evict(EvictParams(num_tokens=100))
    node = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_host_node
    r = start_request(h, [1, 2, 3, 4, 5, 6], load_back=False)
    assert r.prefix_indices.numel() == 0
    h.cache_finished_req(r)  # the evicted node adopts the recomputed slots
    assert node.value.tolist() == r.kv_indices[:4].tolist() and node.host_value.tolist() == [0, 1, 2, 3]
    assert_kv(pool, node.value, [1, 2, 3, 4])
    settle(h)
    h.check_integrity()


def test_load_back_refusals_leave_the_tree_intact():
    h = make_hicache(page_size=2, device_pages=4, host_pages=8, load_back_threshold=4)
    run(h, [1, 2])
    run(h, A)
    settle(h)
    h.evict(EvictParams(num_tokens=100))
    small = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    assert h.init_load_back(small.last_host_node, small.host_hit_length) is None  # under the threshold
    big = h.match_prefix(MatchPrefixParams(key=RadixKey(A)))
    assert h.init_load_back(big.last_host_node, big.host_hit_length, mem_quota=4) is None
    hold = h.token_to_kv_pool_allocator.alloc(4)  # a running request holds 4 of 8 slots
    assert h.init_load_back(big.last_host_node, big.host_hit_length) is None  # 6 needed
    h.check_integrity([hold])
    assert big.last_host_node.evicted and h.ready_to_load_host_cache() == -1
    h.token_to_kv_pool_allocator.free(hold)
    got = h.init_load_back(big.last_host_node, big.host_hit_length)
    assert got.tolist() == [2, 3, 4, 5, 6, 7]
    assert h.ready_to_load_host_cache() == 0
    settle(h)
    h.check_integrity()


def test_pages_fetched_into_fresh_host_slots_enter_as_host_only_nodes():
    h = make_hicache(page_size=2, device_pages=8, host_pages=8)
    host, pool = h.cache_controller.mem_pool_host, h.token_to_kv_pool_allocator.get_kvcache()
    run(h, [1, 2, 3, 4])
    settle(h)
    old = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node.host_value
    fetched = [host.get_data_page(int(i)) for i in old[::2]]  # what a storage backend would return
    h.evict(EvictParams(num_tokens=100))
    h.evict_host(100)
    fresh = host.alloc(4)
    for start, page in zip(fresh[::2].tolist(), fetched):
        host.set_from_flat_data_page(start, page)
    assert h.insert_host(RadixKey([1, 2, 3, 4]), fresh) == 0
    dup = host.alloc(2)
    assert h.insert_host(RadixKey([1, 2]), dup) == 2  # already cached: the caller frees its slots
    host.free(dup)
    held = host.alloc(2)  # host slots a storage operation still holds
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        h.insert_host(RadixKey([7, 7, 7]), held[:1].repeat(3))
    with pytest.raises(ValueError, match="2 host slots for a key of 4"):
        h.insert_host(RadixKey([7, 7, 7, 7]), held)
    h.check_integrity(request_host_indices=[held])
    host.free(held)
    pool.clear()
    r = start_request(h, [1, 2, 3, 4, 5, 6])
    assert r.loaded == 4
    assert_kv(pool, r.kv_indices, [1, 2, 3, 4, 5, 6])
    h.cache_finished_req(r)
    settle(h)
    h.check_integrity()


def test_bad_input():
    h = make_hicache(page_size=2, device_pages=4, host_pages=8)
    run(h, [1, 2])
    settle(h)
    node = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2]))).last_device_node
    with pytest.raises(ValueError, match="not pinned"):
        h.release_host(node)
    with pytest.raises(ValueError, match=">= 0"):
        h.evict_host(-2)
    h.evict(EvictParams(num_tokens=100))
    h.evict_host(100)
    with pytest.raises(ValueError, match="not in this tree"):
        h.init_load_back(node, 2)
    with pytest.raises(ValueError, match="no device copy"):
        h.inc_lock_ref(_evicted(h))
    other = make_hicache(page_size=2)
    with pytest.raises(ValueError, match="differs between the tree's and the controller's CacheInitParams"):
        HiRadixCache(h.params, other.cache_controller)
    with pytest.raises(ValueError, match="unknown write policy"):
        HiCacheController.from_params(h.params, h.cache_controller.mem_pool_host, write_policy="write_sometimes")
    h.check_integrity()


def _evicted(h):
    run(h, [3, 4])
    settle(h)
    h.evict(EvictParams(num_tokens=100))
    return h.match_prefix(MatchPrefixParams(key=RadixKey([3, 4]))).last_host_node


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
