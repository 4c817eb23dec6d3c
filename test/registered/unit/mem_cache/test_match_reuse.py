"""match_prefix_reusing: a request's match is reused exactly while nothing it walked changed,
and redone (with the fresh answer) after every change that could alter it."""

import torch
from tree_fixtures import make_hicache, make_radix

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix.match_reuse import match_prefix_reusing
from sglang.srt.mem_cache.radix.radix_key import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

P = 2


def put(tree, tokens):
    alloc = tree.token_to_kv_pool_allocator
    slots = alloc.alloc(len(tokens))
    alloc.free(slots[: tree.insert(InsertParams(key=RadixKey(tokens), value=slots)).prefix_len])
    return slots


def test_reused_while_unchanged_and_touches_like_a_match():
    tree = make_radix(page_size=P, device_pages=32)
    put(tree, [1, 2, 3, 4, 5, 6])
    key = RadixKey([1, 2, 3, 4, 9, 9, 7])
    first = match_prefix_reusing(tree, key, None)
    assert first.result.device_indices.numel() == 4 and first.walked == 4
    node = first.result.last_device_node  # [1, 2, 3, 4] after the split
    before = (node.last_access_time, node.access_count)
    again = match_prefix_reusing(tree, key, first)
    assert again is first
    assert node.access_count == before[1] + 1 and node.last_access_time > before[0]
    # locks do not change what a match returns
    tree.inc_lock_ref(node)
    assert match_prefix_reusing(tree, key, first) is first
    tree.dec_lock_ref(node)
    # a different key object is always matched afresh
    other = match_prefix_reusing(tree, RadixKey(key.ids), first)
    assert other is not first and torch.equal(other.result.device_indices, first.result.device_indices)


def test_unrelated_insert_keeps_it_a_deeper_path_redoes_it():
    tree = make_radix(page_size=P, device_pages=32)
    put(tree, [1, 2, 3, 4])
    key = RadixKey([1, 2, 3, 4, 5, 6, 7, 8])
    first = match_prefix_reusing(tree, key, None)
    assert first.walked == 4
    put(tree, [1, 2, 3, 4, 8, 8])  # a sibling branch under the match's end: no deeper path for key
    put(tree, [7, 7])
    assert match_prefix_reusing(tree, key, first) is first
    put(tree, [1, 2, 3, 4, 5, 6])  # key can now go one page deeper
    fresh = match_prefix_reusing(tree, key, first)
    assert fresh is not first and fresh.result.device_indices.numel() == 6 and fresh.walked == 6
    assert fresh.result.device_indices.tolist() == tree.match_prefix(MatchPrefixParams(key=key)).device_indices.tolist()


def test_split_evict_and_reset_redo_it():
    tree = make_radix(page_size=P, device_pages=32)
    put(tree, [1, 2, 3, 4, 5, 6])
    key = RadixKey([1, 2, 3, 4, 5, 6])
    first = match_prefix_reusing(tree, key, None)
    tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9, 9])))  # splits the node key walked through
    split = match_prefix_reusing(tree, key, first)
    assert split is not first and len(split.result.path) == 2
    assert split.result.device_indices.tolist() == first.result.device_indices.tolist()
    assert match_prefix_reusing(tree, key, split) is split
    assert tree.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 4  # the whole leaf [3, 4, 5, 6] leaves
    evicted = match_prefix_reusing(tree, key, split)
    assert evicted is not split and evicted.result.device_indices.numel() == 2
    tree.reset()
    after_reset = match_prefix_reusing(tree, key, evicted)
    assert after_reset is not evicted and after_reset.result.device_indices.numel() == 0
    tree.check_integrity()


def test_hicache_eviction_to_host_and_load_back_redo_it():
    tree = make_hicache(page_size=P, device_pages=16, host_pages=32)
    put(tree, [1, 2, 3, 4])
    tree.cache_controller.write_lane.synchronize()
    tree.check_hicache_events()  # the backup is acknowledged: the node is unlocked
    key = RadixKey([1, 2, 3, 4, 5])
    on_device = match_prefix_reusing(tree, key, None)
    assert on_device.result.device_indices.numel() == 4 and on_device.result.host_hit_length == 0
    assert tree.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    on_host = match_prefix_reusing(tree, key, on_device)
    assert on_host is not on_device
    assert on_host.result.device_indices.numel() == 0 and on_host.result.host_hit_length == 4
    assert match_prefix_reusing(tree, key, on_host) is on_host
    loaded = tree.init_load_back(on_host.result.last_host_node, on_host.result.host_hit_length)
    assert loaded is not None and loaded.numel() == 4
    back = match_prefix_reusing(tree, key, on_host)
    assert back is not on_host and back.result.device_indices.tolist() == loaded.tolist()
    tree.ready_to_load_host_cache()
    tree.cache_controller.load_lane.synchronize()
    tree.check_hicache_events()
    tree.check_integrity()
