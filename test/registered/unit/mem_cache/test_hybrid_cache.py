"""Hybrid stacks move every pool of their HostPoolGroup together: the bytes of the anchor and of
every sidecar (or Mamba state) survive device -> host -> device, pools with fewer layers
included; the builders refuse mismatched pools; nothing leaks."""

import pytest
import torch
from tree_fixtures import STACKS, fill_random, params_for, snapshot

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_nsa_hybrid_stack
from sglang.srt.mem_cache.memory_pool import DSAIndexerPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

TOKENS = [3, 1, 4, 1, 5, 9]


def settle(tree):
    tree.cache_controller.synchronize()
    tree.check_hicache_events()


def device_pools(stack):
    return {name: entry.device_pool for name, entry in stack.host_pool_group.entry_map.items()}


@pytest.mark.parametrize("stack_name", sorted(STACKS))
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_round_trip_moves_every_pool(stack_name, layout):
    stack = STACKS[stack_name](HiCacheConfig(io_backend="direct", mem_layout=layout))
    tree, gen = stack.tree_cache, torch.Generator().manual_seed(7)
    pools = device_pools(stack)
    slots = stack.params.token_to_kv_pool_allocator.alloc(len(TOKENS))
    kwargs = {}
    for name, pool in pools.items():
        if name is not PoolName.MAMBA:
            for buf in pool.buffers.values():
                fill_random(buf, slots, gen)
    if PoolName.MAMBA in pools:
        state = pools[PoolName.MAMBA].alloc(1)
        for buf in pools[PoolName.MAMBA].buffers.values():
            fill_random(buf, state, gen)
        kwargs["mamba_value"] = state
    before = {n: snapshot(p, slots if n is not PoolName.MAMBA else state) for n, p in pools.items()}
    assert tree.insert(InsertParams(key=RadixKey(TOKENS), value=slots, **kwargs)).prefix_len == 0
    settle(tree)
    assert tree.evict(EvictParams(num_tokens=len(TOKENS))).num_tokens_evicted == len(TOKENS)
    for pool in pools.values():
        pool.clear()
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(TOKENS)))
    assert m.host_hit_length == len(TOKENS)
    got = tree.init_load_back(m.last_host_node, m.host_hit_length)
    assert tree.ready_to_load_host_cache() == 0
    settle(tree)
    node = m.last_host_node
    assert got.tolist() == node.value.tolist()
    for name, pool in pools.items():
        where = node.mamba_value if name is PoolName.MAMBA else got
        after = snapshot(pool, where)
        for comp in before[name]:
            assert torch.equal(after[comp], before[name][comp]), f"{name.value}/{comp} bytes differ"
    tree.check_integrity()
    tree.reset()
    assert stack.params.token_to_kv_pool_allocator.available_size() == stack.params.token_to_kv_pool_allocator.size
    for entry in stack.host_pool_group.entries:
        if not entry.shares_anchor_slots:
            assert entry.host_pool.available_size() == entry.host_pool.size
    stack.cache_controller.close()


def test_sidecar_layers_fewer_than_the_anchor_are_skipped_not_overrun():
    stack = STACKS["kv_dsa"]()
    controller = stack.cache_controller
    assert controller.layer_num == 2
    indexer = stack.host_pool_group.get_entry(PoolName.INDEXER).host_pool
    assert indexer.layer_num == 1
    stack.cache_controller.close()


def test_builders_refuse_mismatched_pools():
    mla = MLATokenToKVPool(16, 2, torch.bfloat16, 4, 2, 2)
    with pytest.raises(ValueError, match="sidecar uses the anchor's slots"):
        build_nsa_hybrid_stack(params_for(mla), DSAIndexerPool(8, 2, 4, 1), HiCacheConfig(io_backend="direct"))
    mha = MHATokenToKVPool(16, 2, torch.float32, 1, 2, 2)
    with pytest.raises(ValueError, match="this stack needs one of"):
        build_nsa_hybrid_stack(params_for(mha), DSAIndexerPool(16, 2, 4, 1))
    stack = STACKS["kv_dsa"]()
    with pytest.raises(ValueError, match="anchor device pool is not the pool"):
        other = params_for(MLATokenToKVPool(16, 2, torch.bfloat16, 4, 2, 2))
        HybridCacheController(other.token_to_kv_pool_allocator, stack.host_pool_group, 2)
    with pytest.raises(TypeError, match="HostPoolGroup"):
        HybridCacheController(stack.params.token_to_kv_pool_allocator, stack.host_pool_group.anchor_pool, 2)
    stack.cache_controller.close()


def test_host_size_in_gb_buys_anchor_slots_with_their_sidecars():
    stack = STACKS["kv_dsa"](HiCacheConfig(io_backend="direct", hicache_size_gb=1e-6))
    group = stack.host_pool_group
    per_slot_bytes = group.get_size_per_token()
    assert group.size == 1000 // per_slot_bytes // 2 * 2
    assert group.get_entry(PoolName.INDEXER).host_pool.size == group.size
    stack.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
