"""MambaRadixCache (device-only tree of state models): a match ends at the deepest node with a
state, an insert adopts its state or frees it, eviction frees a leaf's KV and state together, and
every state slot is free, a node's or a request's (issue 28)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool.mamba import MambaPool
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

PAGE = 4


@pytest.fixture
def tree():
    alloc = PagedTokenToKVPoolAllocator(64, PAGE)
    states = MambaPool(8, [(2, 3)], (1, 2, 2), 1, conv_dtype=torch.float32)
    return MambaRadixCache(CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=alloc), states)


def _insert(tree, ids, with_state=True):
    kv = tree.token_to_kv_pool_allocator.alloc(len(ids))
    slot = tree.mamba_pool.alloc(1) if with_state else None
    prefix = tree.insert(InsertParams(key=RadixKey(ids), value=kv, mamba_value=slot)).prefix_len
    if prefix:
        tree.token_to_kv_pool_allocator.free(kv[:prefix])
    return slot


def _match(tree, ids):
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(ids)))


def test_match_ends_at_the_last_state(tree):
    a = list(range(100, 112))
    slot = _insert(tree, a[:8])
    _insert(tree, a, with_state=False)  # KV to 12, no state after it
    m = _match(tree, a + [1, 2, 3, 4])
    assert m.device_indices.numel() == 8 and torch.equal(m.last_device_node.mamba_value, slot)
    assert _match(tree, a[:7]).device_indices.numel() == 0  # the state at 8 is past the prompt
    tree.check_integrity()


def test_insert_adopts_one_state_per_node_and_frees_duplicates(tree):
    ids = list(range(200, 208))
    _insert(tree, ids)
    free = tree.mamba_pool.available_size()
    _insert(tree, ids)  # the node has a state: the new slot is freed
    assert tree.mamba_pool.available_size() == free
    tree.check_integrity()


def test_eviction_frees_kv_and_state_together(tree):
    _insert(tree, list(range(300, 308)))
    _insert(tree, list(range(400, 408)))
    free = tree.mamba_pool.available_size()
    out = tree.evict(EvictParams(mamba_num=1))
    assert out.mamba_num_evicted == 1 and out.num_tokens_evicted == 8
    assert tree.mamba_pool.available_size() == free + 1
    assert _match(tree, list(range(300, 309))).device_indices.numel() == 0  # LRU: the older one left
    tree.check_integrity()


def test_integrity_catches_a_leaked_state(tree):
    _insert(tree, list(range(500, 504)))
    tree.check_integrity()
    held = tree.mamba_pool.alloc(1)
    tree.check_integrity(request_mamba_indices=[held])
    with pytest.raises(CacheIntegrityError, match="device mamba pool"):
        tree.check_integrity()
