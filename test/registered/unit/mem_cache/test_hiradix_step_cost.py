"""The per-step HiCache bookkeeping made cheap in issue 9 keeps its meaning: an idle
``check_hicache_events`` issues no collective (all ranks skip together) but one with a write in
flight does; a deferred backup whose copy runs in the submitting thread (a short job) still locks
its nodes until the next ack; the unchecked lock walks move sizes exactly like the checked ones;
the allocator still catches a page named twice in an unsorted free, and a trusted free still
checks the range and double frees; host eviction keeps policy order across calls; a backup takes
the host slots its eviction frees (exactly, with a surplus freed, or topped up from the free
list) without losing one; a due backup's lock becomes its write's lock, or is released when
the host pool refuses it; device eviction picks its leaves from kept candidates and counts of
device children, reading no host-only children; the tree and its nodes keep their state off
CPython's slow attribute paths."""

import pytest
import torch
from tree_fixtures import kv_mamba_stack, make_hicache

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.controller import transfer_lane
from sglang.srt.mem_cache.allocator import PagedAllocator
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

P = 2


def insert(h, tokens, shared=0):
    """Cache ``tokens`` on fresh slots (the first ``shared`` already cached: their duplicates go
    back to the allocator); returns the node the key ends in."""
    slots = h.token_to_kv_pool_allocator.alloc(len(tokens))
    assert h.insert(InsertParams(key=RadixKey(tokens), value=slots)).prefix_len == shared
    if shared:
        h.token_to_kv_pool_allocator.free(slots[:shared])
    return h.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node


def test_idle_check_issues_no_collective_and_a_pending_write_does():
    h = make_hicache(page_size=P, device_pages=8, host_pages=16)
    calls = h.agreement.num_calls
    for _ in range(3):
        h.check_hicache_events()
    assert h.agreement.num_calls == calls  # nothing queued on any rank: every rank skips
    node = insert(h, [1, 2, 3, 4])  # write-through: backed up at once, locked until acked
    assert h.ongoing_write_through and node.lock_ref == 1
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.agreement.num_calls > calls and not h.ongoing_write_through and node.lock_ref == 0
    h.check_integrity()
    h.cache_controller.close()


def test_deferred_backup_run_inline_is_acked_at_the_next_check(monkeypatch):
    # every measured copy counts as short, however loaded the machine (only the unmeasured first
    # one goes to the worker)
    monkeypatch.setattr(transfer_lane, "INLINE_MAX_S", float("inf"))
    h = make_hicache(page_size=P, device_pages=16, host_pages=32)
    h.defer_backups = True
    h.cache_controller.defer_writes = True
    lane = h.cache_controller.write_lane
    nodes = []
    for i in range(3):
        nodes.append(insert(h, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4]))
        assert nodes[-1].lock_ref == 1 and nodes[-1].host_value is None  # due: locked, not yet written
        assert h.flush_backups() == 4
        h.cache_controller.start_writing()
        assert nodes[-1].lock_ref == 1 and nodes[-1].host_value is not None  # written, locked until acked
        h.check_integrity()
        if i == 0:  # the first copy is measured on the lane's worker: acked once it has run
            lane.synchronize()
        h.check_hicache_events()  # later ones ran inline in start_writing: acked at this check
        assert nodes[-1].lock_ref == 0 and not h.ongoing_write_through
    assert lane.num_inline == 2
    # host copies kept
    assert h.evict(EvictParams(num_tokens=12)).num_tokens_evicted == 12 and all(n.evicted and n.backuped for n in nodes)
    h.check_integrity()
    h.cache_controller.close()


def test_unchecked_lock_walks_match_the_checked_ones():
    h = make_hicache(page_size=P, device_pages=16, host_pages=32, write_policy="write_back")
    leaf = insert(h, [1, 2, 3, 4, 5, 6])
    mid = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node  # splits: leaf's parent
    before = (h.evictable_size(), h.protected_size())
    assert h._lock_path(leaf) == -6 and h.inc_lock_ref(leaf) == 0  # leaf 2 tokens + mid 4
    assert (h.evictable_size(), h.protected_size()) == (before[0] - 6, before[1] + 6)
    assert leaf.lock_ref == 2 and mid.lock_ref == 2
    assert h._unlock_path(leaf) == 0  # still locked once
    assert h.dec_lock_ref(leaf) == 6
    assert (h.evictable_size(), h.protected_size()) == before and leaf.lock_ref == mid.lock_ref == 0
    with pytest.raises(ValueError, match="is not locked"):
        h.dec_lock_ref(leaf)  # the public call keeps its checks
    h.check_integrity()
    h.cache_controller.close()


def test_host_eviction_keeps_policy_order_across_calls_and_skips_pinned_nodes():
    h = make_hicache(page_size=P, device_pages=16, host_pages=32)
    keys = {name: [base + i for i in range(4)] for name, base in (("a", 10), ("b", 20), ("c", 30), ("d", 40))}
    nodes = {name: insert(h, k) for name, k in keys.items()}
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=16)).num_tokens_evicted == 16
    assert all(n.evicted and n.backuped for n in nodes.values())
    h.match_prefix(MatchPrefixParams(key=RadixKey(keys["b"])))  # b is now the most recent
    h.protect_host(nodes["a"])  # a, the oldest, is pinned
    order, freed = [], []
    for _ in range(4):
        alive = [name for name, n in nodes.items() if h._is_attached(n)]
        freed.append(h.evict_host(4))
        order += [name for name in alive if not h._is_attached(nodes[name])]
    assert order == ["c", "d", "b"] and freed == [4, 4, 4, 0]  # LRU among the unpinned, b's access counted
    h.release_host(nodes["a"])
    assert h.evict_host(4) == 4 and not h._is_attached(nodes["a"])
    h.check_integrity()
    h.cache_controller.close()


def test_host_eviction_heap_stays_bounded_without_host_evictions():
    h = make_hicache(page_size=P, device_pages=8, host_pages=64)
    tokens = [1, 2, 3, 4]
    node = insert(h, tokens)
    for _ in range(200):  # device copy dropped and loaded back: a push each time, never a host eviction
        h.cache_controller.synchronize()
        h.check_hicache_events()
        assert h.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4 and node.evicted
        m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [9, 9])))
        assert m.host_hit_length == 4 and h.init_load_back(m.last_host_node, 4).numel() == 4
        h.ready_to_load_host_cache()
        h.cache_controller.synchronize()
        h.check_hicache_events()
    assert len(h._host_heap) <= 2 * len(h._host_leaves) + 64
    h.check_integrity()
    h.cache_controller.close()


def backed_up_host_leaves(h, keys):
    """Insert ``keys`` (write-through), acknowledge the writes, drop every device copy."""
    nodes = [insert(h, k) for k in keys]
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=sum(map(len, keys)))).num_tokens_evicted == sum(map(len, keys))
    assert all(n.evicted and n.backuped for n in nodes)
    return nodes


def count_calls(monkeypatch, obj, names):
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(obj, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(obj, name, counted)
    return calls


def test_backup_takes_the_host_slots_its_eviction_frees(monkeypatch):
    h = make_hicache(page_size=P, device_pages=16, host_pages=8)  # host: 16 slots
    assert h._kv_only  # the eviction loops' inline path for a tree without side pools
    host_alloc = h.cache_controller.bindings[h.KV].host_alloc
    keys = [[base + i for i in range(4)] for base in (10, 20, 30, 40)]
    a, b, c, d = backed_up_host_leaves(h, keys)
    assert host_alloc.available_size() == 0
    old = {name: set(n.host_value.tolist()) for name, n in zip("abcd", (a, b, c, d))}
    calls = count_calls(monkeypatch, host_alloc, ["alloc", "free"])

    e = insert(h, [50, 51, 52, 53])  # needs 4: evicts a (LRU), takes its 4 slots
    assert not h._is_attached(a) and set(e.host_value.tolist()) == old["a"]
    assert host_alloc.available_size() == 0 and calls == {"alloc": 0, "free": 0}  # no round trip
    h.check_integrity()

    f = insert(h, [60, 61])  # needs 2: evicts b (4), takes 2 of them, frees the other 2
    assert not h._is_attached(b) and set(f.host_value.tolist()) < old["b"]
    assert host_alloc.available_size() == 2 and calls == {"alloc": 0, "free": 1}
    h.check_integrity()

    g = insert(h, [70, 71, 72, 73, 74, 75])  # needs 6, 2 free: evicts c (4), tops up from the free list
    assert not h._is_attached(c) and calls == {"alloc": 1, "free": 1}
    assert old["c"] < set(g.host_value.tolist()) == old["c"] | (old["b"] - set(f.host_value.tolist()))
    assert host_alloc.available_size() == 0 and g.host_value.numel() == 6
    h.cache_controller.synchronize()
    h.check_hicache_events()
    h.check_integrity()
    h.cache_controller.close()


def test_refused_backup_releases_what_its_eviction_held():
    h = make_hicache(page_size=P, device_pages=16, host_pages=4)  # host: 8 slots
    host_alloc = h.cache_controller.bindings[h.KV].host_alloc
    a, b = backed_up_host_leaves(h, [[10, 11, 12, 13], [20, 21, 22, 23]])
    h.protect_host(b)  # only a can go: 4 slots, short of the 6 needed
    node = insert(h, [30, 31, 32, 33, 34, 35])
    assert node.host_value is None and not h.ongoing_write_through and node.lock_ref == 0
    assert not h._is_attached(a)  # evicted on the way, its slots returned to the free list
    assert host_alloc.available_size() == 4
    h.release_host(b)
    h.check_integrity()
    h.cache_controller.close()


def test_due_backup_keeps_one_lock_into_its_write_or_releases_it():
    h = make_hicache(page_size=P, device_pages=16, host_pages=4)
    h.defer_backups = True
    h.cache_controller.defer_writes = True
    node = insert(h, [1, 2, 3, 4])
    assert node.lock_ref == 1 and h.protected_size() == 4
    assert h.flush_backups() == 4
    assert node.lock_ref == 1 and h.ongoing_write_through == {node.id: node}  # the same lock, not a second
    h.flush_step()  # the write-lane job
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert node.lock_ref == 0 and h.protected_size() == 0 and node.backuped
    h.protect_host(node)  # the host pool (8 slots) has 4 free and nothing evictable
    big = insert(h, [10, 11, 12, 13, 14, 15])
    assert big.lock_ref == 1
    assert h.flush_backups() == 0  # refused: the lock it took when due is released
    assert big.lock_ref == 0 and big.host_value is None and h.protected_size() == 0
    h.release_host(node)
    h.check_integrity()
    h.cache_controller.close()


class CountingChildren(dict):
    """A node's children dict that counts the walks over it (iteration of any kind)."""

    walks = 0

    def values(self):
        CountingChildren.walks += 1
        return super().values()

    def items(self):
        CountingChildren.walks += 1
        return super().items()

    def __iter__(self):
        CountingChildren.walks += 1
        return super().__iter__()


def test_device_eviction_reads_no_children_of_a_prefix_with_many_host_only_ones():
    h = make_hicache(page_size=P, device_pages=64, host_pages=128)
    prefix = [1, 2, 3, 4]
    tails = [[100 + 2 * i, 101 + 2 * i] for i in range(40)]
    for i, tail in enumerate(tails):  # one shared prefix, 40 children, all backed up then dropped from device
        insert(h, prefix + tail, shared=4 if i else 0)
    h.cache_controller.synchronize()
    h.check_hicache_events()
    top = h.match_prefix(MatchPrefixParams(key=RadixKey(prefix))).last_device_node
    assert h.evict(EvictParams(num_tokens=80)).num_tokens_evicted == 80
    assert len(top.children) == 40 and top.device_children == 0
    live = insert(h, prefix + [7, 8], shared=4)  # the prefix's one device child
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert top.device_children == 1 and not h._is_device_leaf(top)
    top.children = CountingChildren(top.children)
    CountingChildren.walks = 0
    # the device leaf goes; the prefix becomes one
    assert h.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 2 and live.evicted
    assert h._is_device_leaf(top) and h._device_candidates[top.id] is top
    # and goes next, its 41 host-only children untouched
    assert h.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4 and top.evicted
    assert CountingChildren.walks == 0
    h.check_integrity()
    h.cache_controller.close()


def test_integrity_check_catches_a_wrong_device_child_count_or_a_missing_candidate():
    h = make_hicache(page_size=P, device_pages=16, host_pages=32)
    leaf = insert(h, [1, 2, 3, 4, 5, 6])
    insert(h, [1, 2, 3, 4, 7, 8], shared=4)  # splits the leaf: a parent [1..4] with two device children
    top = h.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node
    assert top.device_children == 2 and leaf.parent is top
    h.cache_controller.synchronize()
    h.check_hicache_events()
    h.check_integrity()
    top.device_children -= 1
    with pytest.raises(CacheIntegrityError, match="children on device"):
        h.check_integrity()
    top.device_children += 1
    del h._device_candidates[leaf.id]
    with pytest.raises(CacheIntegrityError, match="missing from the device eviction candidates"):
        h.check_integrity()
    h._device_candidates[leaf.id] = leaf
    h.check_integrity()
    h.cache_controller.close()


def test_a_loaded_back_chain_is_a_device_eviction_candidate_again():
    h = make_hicache(page_size=P, device_pages=16, host_pages=32)
    tokens = [1, 2, 3, 4, 5, 6]
    node = insert(h, tokens)
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6 and node.evicted
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [9, 9])))
    assert h.init_load_back(m.last_host_node, m.host_hit_length).numel() == 6
    assert h._device_candidates[node.id] is node and node.parent.device_children == 1
    h.ready_to_load_host_cache()
    h.cache_controller.synchronize()
    h.check_hicache_events()
    h.check_integrity()
    # found without a walk of the tree
    assert h.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6 and node.evicted
    h.check_integrity()
    h.cache_controller.close()


def test_tree_state_stays_off_the_interpreter_slow_attribute_paths():
    """CPython keeps an instance's attributes in a shared-key layout (specialized reads and
    method calls) only up to 30 names: the HiCache trees keep theirs in slots, nodes have no
    instance dict at all."""
    h = make_hicache(page_size=P, device_pages=16, host_pages=32)
    insert(h, [1, 2, 3, 4])
    assert all(hasattr(h, name) for name in HiRadixCache.__slots__)  # every slot is the tree's state
    assert len(vars(h)) < 30, sorted(vars(h))
    mamba_tree = kv_mamba_stack(HiCacheConfig(io_backend="direct")).tree_cache
    assert isinstance(mamba_tree, HiRadixCache) and len(vars(mamba_tree)) < 30, sorted(vars(mamba_tree))
    node = TreeNode()
    assert not hasattr(node, "__dict__")
    before = node.stamp
    node.value = torch.tensor([1, 2])  # a stamped write still moves the stamp
    assert node.stamp > before and node._value is node.value
    with pytest.raises(AttributeError):
        node.something_else = 1
    h.cache_controller.close()
    mamba_tree.cache_controller.close()


def test_free_catches_a_page_named_twice_in_any_order():
    alloc = PagedAllocator(8, 2)
    slots = alloc.alloc(8)  # pages 0..3
    with pytest.raises(ValueError, match="same page twice"):
        alloc.free(torch.tensor([6, 7, 2, 3, 6, 7]))  # unsorted, page 3 twice
    assert alloc.available_size() == 8  # nothing was freed
    alloc.free(torch.tensor([6, 7, 0, 1, 4, 5]))  # unsorted, unique
    assert alloc.available_size() == 14
    alloc.free(slots[2:4])
    assert alloc.available_size() == 16
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots[:2], trusted=True)  # trusted skips the page check only
    with pytest.raises(ValueError, match="out of range"):
        alloc.free(torch.tensor([16, 17]), trusted=True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
