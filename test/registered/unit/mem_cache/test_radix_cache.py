"""RadixCache storylines: exact slot ids, eviction order per policy, namespaces, hash chains,
split consistency, request helpers, bad input and the integrity check."""

import pytest
import torch
from tree_fixtures import assert_kv, held_pages, make_params, make_radix, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def K(*tokens, extra_key=None):
    return RadixKey(list(tokens), extra_key)


def test_insert_match_and_lru_eviction_order():
    c = make_radix(page_size=1, device_pages=8)
    alloc = c.token_to_kv_pool_allocator
    s1 = alloc.alloc(3)
    assert s1.tolist() == [1, 2, 3]  # slot 0 is the reserved padding page
    assert c.insert(InsertParams(key=K(1, 2, 3), value=s1)).prefix_len == 0
    s2 = alloc.alloc(4)
    assert s2.tolist() == [4, 5, 6, 7]
    # [1, 2] was cached: the caller frees 4, 5
    assert c.insert(InsertParams(key=K(1, 2, 4, 5), value=s2)).prefix_len == 2
    alloc.free(s2[:2])
    m = c.match_prefix(MatchPrefixParams(key=K(1, 2, 4, 9)))
    assert m.device_indices.tolist() == [1, 2, 6]
    assert m.last_device_node is m.last_host_node and m.host_hit_length == 0
    assert (c.evictable_size(), c.protected_size(), alloc.available_size()) == (5, 0, 3)
    c.check_integrity()
    # [3] was touched before [4, 5] and before the split of [4, 5] into [4] + [5]
    assert c.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 1 and alloc.is_free(torch.tensor([3])).all()
    assert c.match_prefix(MatchPrefixParams(key=K(1, 2, 3))).device_indices.tolist() == [1, 2]
    assert c.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 1 and alloc.is_free(torch.tensor([7])).all()
    assert c.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 3 and alloc.available_size() == 8
    c.check_integrity()


def test_lfu_keeps_the_frequent_prefix_that_lru_would_drop():
    for policy, survivor, victim_len in (("lru", (7, 8), 3), ("lfu", (1, 2, 3), 2)):
        c = make_radix(page_size=1, device_pages=8, eviction_policy=policy)
        alloc = c.token_to_kv_pool_allocator
        c.insert(InsertParams(key=K(1, 2, 3), value=alloc.alloc(3)))
        c.insert(InsertParams(key=K(7, 8), value=alloc.alloc(2)))
        for _ in range(3):
            c.match_prefix(MatchPrefixParams(key=K(1, 2, 3)))
        c.match_prefix(MatchPrefixParams(key=K(7, 8)))  # most recent, but least frequent
        assert c.evict(EvictParams(num_tokens=1)).num_tokens_evicted == victim_len
        assert c.match_prefix(MatchPrefixParams(key=K(*survivor))).device_indices.numel() == len(survivor)
        c.check_integrity()


def test_locks_protect_a_node_and_its_ancestors():
    c = make_radix(page_size=2, device_pages=8)
    alloc = c.token_to_kv_pool_allocator
    c.insert(InsertParams(key=K(1, 2, 3, 4), value=alloc.alloc(4)))
    dup = alloc.alloc(4)
    assert c.insert(InsertParams(key=K(1, 2, 5, 6), value=dup)).prefix_len == 2
    alloc.free(dup[:2])
    leaf = c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4))).last_device_node
    assert c.inc_lock_ref(leaf) == -4  # the leaf [3, 4] and its parent [1, 2]
    assert (c.evictable_size(), c.protected_size()) == (2, 4)
    assert c.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 2  # only [5, 6] can go
    assert c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4))).device_indices.numel() == 4
    assert c.dec_lock_ref(leaf) == 4
    with pytest.raises(ValueError, match="not locked"):
        c.dec_lock_ref(leaf)
    c.check_integrity()
    assert c.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 4
    with pytest.raises(ValueError, match="not in this tree"):
        c.inc_lock_ref(leaf)


def test_namespaces_never_share_a_match_and_hash_chains_are_seeded():
    c = make_radix(page_size=2, device_pages=8)
    alloc = c.token_to_kv_pool_allocator
    c.insert(InsertParams(key=K(1, 2, 3, 4), value=alloc.alloc(4)))
    c.insert(InsertParams(key=K(1, 2, 3, 4, extra_key="lora-a"), value=alloc.alloc(4)))
    assert c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4, extra_key="lora-b"))).device_indices.numel() == 0
    a = c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4, extra_key="lora-a"))).last_device_node
    d = c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4))).last_device_node
    assert a is not d
    assert d.hash_value == page_hashes([1, 2, 3, 4], 2, namespace_hash(None))
    assert a.hash_value == page_hashes([1, 2, 3, 4], 2, namespace_hash("lora-a"))
    assert set(a.hash_value).isdisjoint(d.hash_value)
    c.check_integrity()


def test_split_slices_values_and_hashes_without_rehashing():
    c = make_radix(page_size=2, device_pages=8)
    alloc = c.token_to_kv_pool_allocator
    slots = alloc.alloc(6)
    c.insert(InsertParams(key=K(1, 2, 3, 4, 5, 6), value=slots))
    node = c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4, 5, 6))).last_device_node
    full = page_hashes([1, 2, 3, 4, 5, 6], 2, namespace_hash(None))
    assert c.insert(InsertParams(key=K(1, 2, 3, 4, 9, 9), value=alloc.alloc(6))).prefix_len == 4
    upper = node.parent
    assert upper.key.token_ids == [1, 2, 3, 4] and upper.hash_value == full[:2]
    assert node.key.token_ids == [5, 6] and node.hash_value == full[2:]
    assert upper.value.tolist() == slots[:4].tolist() and node.value.tolist() == slots[4:].tolist()
    # a trailing partial page never matches
    assert c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4, 5))).device_indices.tolist() == slots[:4].tolist()
    with pytest.raises(CacheIntegrityError, match="slots are neither free nor owned"):
        c.check_integrity()  # the duplicate [1, 2, 3, 4] slots of the second insert are not freed yet


def test_requests_cache_their_pages_and_leave_no_leak():
    c = make_radix(page_size=4, device_pages=8)
    alloc, pool = c.token_to_kv_pool_allocator, c.token_to_kv_pool_allocator.get_kvcache()
    tokens = list(range(10))  # two whole pages + a tail of 2
    r1 = start_request(c, tokens)
    c.check_integrity(held_pages(c, [r1]))
    c.cache_finished_req(r1)
    assert c.total_size() == 8 and alloc.available_size() == 32 - 8
    r2 = start_request(c, tokens[:8] + [50, 51, 52, 53, 54])
    assert r2.prefix_indices.tolist() == r1.kv_indices[:8].tolist()
    assert_kv(pool, r2.kv_indices, r2.fill_ids)
    c.cache_unfinished_req(r2)  # caches [50..53], keeps its lock on the new node
    assert r2.last_node.key.token_ids == [50, 51, 52, 53] and r2.prefix_indices.numel() == 12
    c.check_integrity(held_pages(c, [r2]))
    c.cache_finished_req(r2)
    c.check_integrity()
    c.reset()
    assert alloc.available_size() == alloc.size


def test_bad_input_is_refused_without_changes():
    c = make_radix(page_size=2, device_pages=4)
    alloc = c.token_to_kv_pool_allocator
    with pytest.raises(ValueError, match="2 slots for a key of 4"):
        c.insert(InsertParams(key=K(1, 2, 3, 4), value=torch.tensor([2, 3])))
    with pytest.raises(ValueError, match="not .* consecutive|not a multiple"):
        c.insert(InsertParams(key=K(1, 2, 3, 4), value=torch.tensor([2, 3, 5, 4])))
    with pytest.raises(TypeError, match="RadixKey"):
        c.match_prefix(MatchPrefixParams(key=[1, 2]))
    with pytest.raises(TypeError, match="extra_key"):
        RadixKey([1, 2], extra_key=3)
    with pytest.raises(ValueError, match=">= 0"):
        c.evict(EvictParams(num_tokens=-1))
    with pytest.raises(TypeError, match="MatchPrefixParams"):
        c.match_prefix(K(1, 2))  # the old call shape names the new one
    with pytest.raises(TypeError, match="InsertParams"):
        c.insert(K(1, 2))
    with pytest.raises(TypeError, match="value"):
        c.insert(InsertParams(key=K(1, 2)))  # a real tree needs slots
    with pytest.raises(ValueError, match="mamba_num"):
        c.evict(EvictParams(mamba_num=1))
    assert c.total_size() == 0 and not c.root_node.children
    with pytest.raises(ValueError, match="eviction policy 'fifo'"):
        CacheInitParams(page_size=2, eviction_policy="fifo")
    with pytest.raises(ValueError, match="allocator page_size"):
        RadixCache(CacheInitParams(page_size=4, token_to_kv_pool_allocator=alloc))
    disabled = RadixCache(CacheInitParams(disable=True))
    assert disabled.match_prefix(MatchPrefixParams(key=K(1, 2))).device_indices.numel() == 0
    assert disabled.insert(InsertParams(key=K(1), value=torch.tensor([1]))).prefix_len == 0  # takes nothing
    assert disabled.total_size() == 0 and not disabled.root_node.children


def test_insert_takes_whole_pages_and_leaves_the_partial_page_to_the_caller():
    c = make_radix(page_size=2, device_pages=4)
    alloc = c.token_to_kv_pool_allocator
    slots = alloc.alloc(4)
    assert slots.tolist() == [2, 3, 4, 5]
    assert c.insert(InsertParams(key=K(1, 2, 3), value=slots[:3])).prefix_len == 0
    assert c.total_size() == 2 and c.all_values_flatten().tolist() == [2, 3]
    alloc.free(slots[2:])  # the partial page [3] (slots 4, 5) stayed the caller's
    c.check_integrity()


def test_integrity_check_reports_numbers():
    c = RadixCache(make_params(page_size=1, device_pages=8))
    alloc = c.token_to_kv_pool_allocator
    slots = alloc.alloc(3)
    c.insert(InsertParams(key=K(1, 2, 3), value=slots))
    alloc.free(slots[:1])  # behind the tree's back
    with pytest.raises(CacheIntegrityError, match=r"1 are counted more than once \(e.g. \[1\]\)"):
        c.check_integrity()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
