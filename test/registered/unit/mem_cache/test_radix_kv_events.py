"""KV cache events of the trees: exact ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
for insert, split, eviction, host backup, load-back, host eviction and reset, and a replay
check: applying the events in order rebuilds exactly the pages each tier holds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_fixtures import make_hicache, make_radix

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

GPU, CPU = StorageMedium.GPU.value, StorageMedium.CPU.value


def blocks(tokens, page_size=2, extra_key=None) -> list[int]:
    """The block hash of every page of ``tokens``: the first 64 bits of its page hash, signed."""
    out = []
    for h in page_hashes(tokens, page_size, namespace_hash(extra_key)):
        v = int(h[:16], 16)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


def stored(hashes, parent, tokens, medium, page_size=2) -> BlockStored:
    return BlockStored([hashes], parent, list(tokens), page_size, None, medium=medium)


def replay(events, state=None) -> dict[str, set[int]]:
    """Blocks per medium after ``events`` (what a router rebuilds)."""
    state = state if state is not None else {GPU: set(), CPU: set()}
    for e in events:
        if isinstance(e, AllBlocksCleared):
            for tier in state.values():
                tier.clear()
        elif isinstance(e, BlockStored):
            state[e.medium].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= state[e.medium], "removed a block never stored"
            state[e.medium].difference_update(e.block_hashes)
    return state


def held(tree) -> dict[str, set[int]]:
    """Blocks per medium the tree actually holds."""
    out = {GPU: set(), CPU: set()}
    for node in tree._all_nodes():
        ints = set()
        for h in node.hash_value:
            v = int(h[:16], 16)
            ints.add(v - (1 << 64) if v >= 1 << 63 else v)
        if node.value is not None:
            out[GPU] |= ints
        if node.host_value is not None:
            out[CPU] |= ints
    return out


def insert(tree, tokens, extra_key=None) -> int:
    alloc = tree.token_to_kv_pool_allocator
    slots = alloc.alloc(len(tokens))
    n = tree.insert(InsertParams(key=RadixKey(tokens, extra_key), value=slots)).prefix_len
    alloc.free(slots[:n])
    return n


def test_events_are_off_by_default_and_cost_no_recorder():
    c = make_radix(page_size=2, device_pages=8)
    assert c.kv_events is None and c.enable_kv_cache_events is False
    insert(c, [1, 2, 3, 4])
    c.evict(EvictParams(num_tokens=4))
    c.reset()
    assert c.take_events() == []
    assert RadixCache(CacheInitParams(disable=True, enable_kv_cache_events=True)).kv_events is None


def test_device_tree_storyline():
    c = RadixCache(CacheInitParams(page_size=2, enable_kv_cache_events=True,
                                   token_to_kv_pool_allocator=make_radix(2, 8).token_to_kv_pool_allocator))
    assert c.take_events() == [AllBlocksCleared()]
    a, b = blocks([1, 2, 3, 4]), blocks([1, 2, 5, 6])
    insert(c, [1, 2, 3, 4])
    assert c.take_events() == [stored(a[0], None, [1, 2], GPU), stored(a[1], a[0], [3, 4], GPU)]
    assert insert(c, [1, 2, 5, 6]) == 2  # splits [1..4]: the split itself says nothing
    assert c.take_events() == [stored(b[1], a[0], [5, 6], GPU)]
    assert c.take_events() == []  # drained
    c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 5, 6])))  # [3, 4] is now the older leaf
    assert c.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 2
    assert c.take_events() == [BlockRemoved([a[1]], medium=GPU)]
    c.evict(EvictParams(num_tokens=4))
    assert c.take_events() == [BlockRemoved([b[1]], medium=GPU), BlockRemoved([a[0]], medium=GPU)]
    insert(c, [1, 2, 3, 4, 5, 6])
    assert [e.block_hashes for e in c.take_events()] == [[h] for h in blocks([1, 2, 3, 4, 5, 6])]
    c.reset()
    assert c.take_events() == [AllBlocksCleared()]


def test_block_hashes_follow_the_namespace():
    c = RadixCache.create_simulated(page_size=2, enable_kv_cache_events=True)
    c.take_events()
    c.insert(InsertParams(key=RadixKey([1, 2], "tenant-a"), value=None))
    c.insert(InsertParams(key=RadixKey([1, 2]), value=None))
    a, d = c.take_events()
    assert a.block_hashes == blocks([1, 2], extra_key="tenant-a") and d.block_hashes == blocks([1, 2])
    assert a.block_hashes != d.block_hashes


def test_hierarchical_tree_storyline_names_the_tier():
    h = make_hicache(page_size=2, device_pages=8, host_pages=16, enable_kv_cache_events=True)
    try:
        assert h.take_events() == [AllBlocksCleared()]
        a, b = blocks([1, 2, 3, 4]), blocks([1, 2, 5, 6])
        insert(h, [1, 2, 3, 4])  # write-through: its host write is queued now
        insert(h, [1, 2, 5, 6])  # splits the node while its write is in flight
        assert h.take_events() == [stored(a[0], None, [1, 2], GPU), stored(a[1], a[0], [3, 4], GPU),
                                   stored(b[1], a[0], [5, 6], GPU)]
        h.cache_controller.synchronize()
        h.check_hicache_events()
        # both fragments of the split write are published, parentage intact
        assert h.take_events() == [stored(a[0], None, [1, 2], CPU), stored(a[1], a[0], [3, 4], CPU),
                                   stored(b[1], a[0], [5, 6], CPU)]
        assert h.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 6  # to host: copies kept there
        assert h.take_events() == [BlockRemoved([a[1]], medium=GPU), BlockRemoved([b[1]], medium=GPU),
                                   BlockRemoved([a[0]], medium=GPU)]
        m = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4])))
        assert m.host_hit_length == 4 and h.init_load_back(m.last_host_node, m.host_hit_length).numel() == 4
        assert h.take_events() == [stored(a[0], None, [1, 2], GPU), stored(a[1], a[0], [3, 4], GPU)]
        h.ready_to_load_host_cache()
        h.cache_controller.synchronize()
        h.check_hicache_events()
        h.evict(EvictParams(num_tokens=8))
        assert h.evict_host(16) == 6
        assert h.take_events() == [
            BlockRemoved([a[1]], medium=GPU), BlockRemoved([a[0]], medium=GPU),
            BlockRemoved([b[1]], medium=CPU), BlockRemoved([a[1]], medium=CPU), BlockRemoved([a[0]], medium=CPU),
        ]
        h.reset()
        assert h.take_events() == [AllBlocksCleared()]
    finally:
        h.cache_controller.close()


def test_a_dropped_unbacked_leaf_and_its_host_only_children_are_removed_from_both_tiers():
    h = make_hicache(page_size=2, device_pages=8, host_pages=16, write_policy="write_through_selective",
                     enable_kv_cache_events=True)
    try:
        insert(h, [1, 2])  # one hit: below the selective threshold, no host copy
        host = h.cache_controller.mem_pool_host
        pages = host.alloc(4)
        assert h.insert_host(RadixKey([1, 2, 3, 4]), pages) == 2  # e.g. pages fetched from storage
        host.free(pages[:2])
        a = blocks([1, 2, 3, 4])
        assert h.take_events()[1:] == [stored(a[0], None, [1, 2], GPU), stored(a[1], a[0], [3, 4], CPU)]
        assert h.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 2  # [1, 2] goes with its host-only child
        assert h.take_events() == [BlockRemoved([a[1]], medium=CPU), BlockRemoved([a[0]], medium=GPU)]
        assert held(h) == {GPU: set(), CPU: set()} and not h.root_node.children
        h.check_integrity()
    finally:
        h.cache_controller.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "evict", "evict_host", "ack", "load", "reset"]),
                          st.lists(st.integers(1, 3), min_size=1, max_size=8)), max_size=25))
def test_replaying_the_events_rebuilds_each_tier(ops):
    h = make_hicache(page_size=2, device_pages=12, host_pages=24, enable_kv_cache_events=True)
    try:
        state = replay(h.take_events())
        for op, tokens in ops:
            tokens = tokens[: len(tokens) // 2 * 2] or [1, 1]
            if op == "insert" and h.token_to_kv_pool_allocator.available_size() >= len(tokens):
                insert(h, tokens)
            elif op == "match":
                m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
                if m.host_hit_length:
                    h.init_load_back(m.last_host_node, m.host_hit_length)
            elif op == "evict":
                h.evict(EvictParams(num_tokens=len(tokens)))
            elif op == "evict_host":
                h.evict_host(len(tokens))
            elif op in ("ack", "load"):
                h.ready_to_load_host_cache()
                h.cache_controller.synchronize()
                h.check_hicache_events()
            elif op == "reset":
                h.cache_controller.synchronize()
                h.check_hicache_events()
                h.reset()
            h.cache_controller.synchronize()  # a host copy is published when its write is acknowledged
            h.check_hicache_events()
            replay(h.take_events(), state)
            assert state == held(h)
    finally:
        h.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
