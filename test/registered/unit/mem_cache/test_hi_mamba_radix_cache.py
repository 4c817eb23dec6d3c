"""HiMambaRadixCache storylines: matches end where a state is known, states move with their KV
between tiers (bytes checked), host copies stay a contiguous prefix from the root, request
state slots are adopted or freed, and nothing leaks."""

from dataclasses import dataclass

import pytest
import torch
from tree_fixtures import fill_random, kv_mamba_stack, snapshot

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@dataclass
class MambaReq:
    fill_ids: list
    extra_key: object
    kv_indices: torch.Tensor
    prefix_indices: torch.Tensor
    last_node: object
    mamba_pool_idx: torch.Tensor


class Env:
    def __init__(self, write_policy="write_through"):
        self.stack = kv_mamba_stack(HiCacheConfig(io_backend="direct", write_policy=write_policy))
        self.tree = self.stack.tree_cache
        self.alloc = self.stack.params.token_to_kv_pool_allocator
        self.mamba = self.stack.host_pool_group.get_entry(PoolName.MAMBA).device_pool
        self.mamba_host = self.stack.host_pool_group.get_entry(PoolName.MAMBA).host_pool
        self.gen = torch.Generator().manual_seed(3)

    def insert(self, tokens, with_state=True):
        """Cache ``tokens`` on fresh slots; returns the state slot given (or None)."""
        slots = self.alloc.alloc(len(tokens))
        state = None
        if with_state:
            state = self.mamba.alloc(1)
            for buf in self.mamba.buffers.values():
                fill_random(buf, state, self.gen)
        prefix = self.tree.insert(InsertParams(key=RadixKey(tokens), value=slots, mamba_value=state)).prefix_len
        if prefix:
            self.alloc.free(slots[:prefix])
        return state

    def settle(self):
        self.tree.cache_controller.synchronize()
        self.tree.check_hicache_events()

    def match(self, tokens):
        return self.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))


def test_eviction_keeps_the_slot_hooks_of_side_pools():
    env = Env()
    assert env.tree._kv_only is False  # its per-node hooks move the states too: no inline KV-only path
    env.insert([1, 2, 3, 4])
    env.settle()
    node = env.match([1, 2, 3, 4]).last_device_node
    assert node.mamba_value is not None and node.mamba_host_value is not None
    assert env.tree.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    assert node.mamba_value is None and node.mamba_host_value is not None  # the state left the device with the KV
    assert env.tree.evict_host(4) == 4 and not env.tree._is_attached(node)
    env.tree.check_integrity()


def test_match_ends_at_the_deepest_known_state():
    env = Env()
    env.insert([1, 2, 3, 4])
    env.insert([1, 2, 3, 4, 5, 6], with_state=False)
    m = env.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.device_indices.numel() == 4 and m.last_device_node.mamba_value is not None
    env.insert([1, 2, 9, 9])  # splits [1, 2, 3, 4]: the state stays with the lower part
    assert env.match([1, 2, 3, 4]).device_indices.numel() == 4
    assert env.match([1, 2, 7, 7]).device_indices.numel() == 0  # [1, 2] has no state
    env.settle()
    env.tree.check_integrity()


def test_state_moves_with_its_kv_through_the_host():
    env = Env()
    state = env.insert([1, 2, 3, 4])
    before = snapshot(env.mamba, state)
    env.settle()
    node = env.match([1, 2, 3, 4]).last_device_node
    assert node.mamba_host_value.tolist() == [0] and env.mamba_host.available_size() == env.mamba_host.size - 1
    assert env.tree.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    assert node.mamba_value is None and env.mamba.available_size() == 4
    env.mamba.clear()
    m = env.match([1, 2, 3, 4])
    assert (m.host_hit_length, m.last_host_node) == (4, node)
    got = env.tree.init_load_back(m.last_host_node, m.host_hit_length)
    env.tree.ready_to_load_host_cache()
    env.settle()
    assert got.tolist() == node.value.tolist() and node.mamba_value is not None
    after = snapshot(env.mamba, node.mamba_value)
    assert all(torch.equal(after[c], before[c]) for c in before)
    env.tree.check_integrity()


def test_load_back_returns_the_stateless_device_bridge_too():
    env = Env()
    env.insert([1, 2])
    env.insert([1, 2, 3, 4], with_state=False)
    env.insert([1, 2, 3, 4, 5, 6])
    env.settle()
    leaf = env.match([1, 2, 3, 4, 5, 6]).last_device_node
    env.tree.evict(EvictParams(num_tokens=2))  # only the leaf [5, 6] goes
    m = env.match([1, 2, 3, 4, 5, 6])
    assert m.device_indices.numel() == 2 and m.host_hit_length == 4  # [3, 4] (no state) + [5, 6]
    got = env.tree.init_load_back(m.last_host_node, m.host_hit_length)
    bridge = m.last_host_node.parent.value
    assert got.tolist() == bridge.tolist() + leaf.value.tolist()
    env.tree.ready_to_load_host_cache()
    env.settle()
    env.tree.check_integrity()


def test_write_back_backs_up_the_unbacked_ancestors_too():
    env = Env(write_policy="write_back")
    env.insert([1, 2, 3, 4])
    env.insert([1, 2, 5, 6])
    upper = env.match([1, 2, 5, 6]).last_device_node.parent
    assert upper.key.token_ids == [1, 2] and not upper.backuped
    assert env.tree.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 2
    assert upper.backuped and not upper.evicted  # copied to keep the host prefix contiguous
    env.tree.check_integrity()
    env.settle()
    env.tree.check_integrity()


def test_requests_hand_their_state_to_the_tree_or_free_it():
    env = Env()
    first = None
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5]):  # new, duplicate, unaligned
        m = env.match(tokens)
        env.tree.inc_lock_ref(m.last_device_node)
        n = m.device_indices.numel()
        own = env.alloc.alloc(-(-(len(tokens) - n) // 2) * 2)
        state = env.mamba.alloc(1)
        req = MambaReq(tokens, None, torch.cat([m.device_indices, own])[: len(tokens)], m.device_indices,
                       m.last_device_node, state)
        env.tree.cache_finished_req(req)
        first = state if first is None else first
        node = env.match([1, 2, 3, 4]).last_device_node
        assert node.mamba_value.tolist() == first.tolist()
        assert bool(env.mamba.allocator.is_free(state)) == (state is not first)
        env.tree.check_integrity()
    assert env.alloc.available_size() == env.alloc.size - 4
    env.settle()
    env.tree.check_integrity()


def test_running_request_caches_its_pages_without_a_state():
    env = Env()
    tokens = [1, 2, 3, 4, 5]
    kv = env.alloc.alloc(6)[:5]
    req = MambaReq(tokens, None, kv, kv[:0], env.tree.root_node, env.mamba.alloc(1))
    env.tree.cache_unfinished_req(req)  # [1..4] cached on device, no state known for it yet
    assert req.prefix_indices.tolist() == kv[:4].tolist() and req.last_node.mamba_value is None
    assert env.match(tokens).device_indices.numel() == 0
    env.tree.check_integrity([env.alloc.pages_to_slots(kv[4:5] // 2)], request_mamba_indices=[req.mamba_pool_idx])
    env.tree.cache_finished_req(req)  # unaligned: the state slot is freed
    env.settle()
    env.tree.check_integrity()
    assert env.mamba.available_size() == 4


def test_evict_mamba_and_the_leak_check():
    env = Env()
    for tokens in ([1, 2], [3, 4], [5, 6], [7, 8]):
        env.insert(tokens)
    assert env.mamba.available_size() == 0
    env.settle()
    assert env.tree.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1 and env.mamba.available_size() == 1
    env.tree.check_integrity()
    slots = env.alloc.alloc(2)
    with pytest.raises(ValueError, match="one slot"):
        env.tree.insert(InsertParams(key=RadixKey([9, 9]), value=slots, mamba_value=torch.tensor([1, 2])))
    env.tree.check_integrity([slots])  # refused whole: the caller still holds its slots
    env.alloc.free(slots)
    env.tree.reset()
    assert env.mamba.available_size() == 4 and env.mamba_host.available_size() == env.mamba_host.size
    assert env.alloc.available_size() == env.alloc.size
    env.stack.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
