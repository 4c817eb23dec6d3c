"""Stateful test of HiMambaRadixCache: random requests that hand their final state to the tree,
device / host / state evictions and load-backs, under each write policy. The KV of a token and
the Mamba state after a prefix are functions of the prefix, so every hit is checked byte for
byte; check_integrity() (both KV pools and both Mamba pools) holds after every step."""

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tree_fixtures import assert_kv, held_pages, kv_mamba_stack, token_values, write_kv

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

# A few fixed sequences sharing prefixes, sometimes extended: requests often end exactly where
# an earlier one did, which is where a state is cached.
SEQS = [[4, 4], [4, 4, 1, 2], [4, 4, 1, 2, 0, 0], [4, 4, 1, 2, 2, 1], [1, 1, 1], [4, 4, 1]]
tokens_st = st.tuples(st.sampled_from(SEQS), st.sampled_from([[], [], [0, 1], [2]])).map(lambda t: t[0] + t[1])


def expected_state(pool, tokens) -> dict[str, torch.Tensor]:
    v = float(token_values(tokens)[-1])
    out = {}
    for name, buf in pool.buffers.items():
        shape = (buf.shape[0], *buf.shape[2:])
        ramp = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) % 64
        out[name] = (ramp + v % 128).to(buf.dtype)  # small integers: exact in bf16 and fp32
    return out


def write_state(pool, slot, tokens) -> None:
    for name, value in expected_state(pool, tokens).items():
        pool.buffers[name][:, slot] = value.unsqueeze(1)


def assert_state(pool, slot, tokens) -> None:
    for name, value in expected_state(pool, tokens).items():
        assert torch.equal(pool.buffers[name][:, int(slot)], value), f"Mamba {name} state differs"


@dataclass
class Req:
    fill_ids: list
    extra_key: object
    kv_indices: torch.Tensor
    prefix_indices: torch.Tensor
    last_node: object
    mamba_pool_idx: torch.Tensor


class HiMambaMachine(RuleBasedStateMachine):
    @initialize(write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                ratio=st.sampled_from([1.0, 3.0]))
    def setup(self, write_policy, ratio):
        self.stack = kv_mamba_stack(HiCacheConfig(io_backend="direct", write_policy=write_policy, hicache_ratio=ratio))
        self.tree = self.stack.tree_cache
        self.alloc = self.stack.params.token_to_kv_pool_allocator
        self.kv = self.alloc.get_kvcache()
        self.mamba = self.stack.host_pool_group.get_entry(PoolName.MAMBA).device_pool
        self.running = []

    def _match(self, tokens, load_back):
        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        prefix, last = m.device_indices, m.last_device_node
        if load_back and m.host_hit_length:
            got = self.tree.init_load_back(m.last_host_node, m.host_hit_length)
            if got is not None:
                prefix, last = torch.cat([prefix, got]), m.last_host_node
                self.tree.ready_to_load_host_cache()
                self.tree.cache_controller.load_lane.synchronize()
        n = prefix.numel()
        assert_kv(self.kv, prefix, tokens[:n])
        if n:
            assert_state(self.mamba, last.mamba_value, tokens[:n])
        return prefix, last

    @rule(tokens=tokens_st, load_back=st.booleans(), keep_running=st.booleans())
    def request(self, tokens, load_back, keep_running):
        prefix, last = self._match(tokens, load_back)
        self.tree.inc_lock_ref(last)
        need = -(-(len(tokens) - prefix.numel()) // 2) * 2
        if self.alloc.available_size() < need:
            self.tree.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        if self.mamba.available_size() < 1:
            self.tree.evict(EvictParams(mamba_num=1))
        own, state = self.alloc.alloc(need), self.mamba.alloc(1)
        if own is None or state is None:
            for pool, got in ((self.alloc, own), (self.mamba, state)):
                if got is not None:
                    pool.free(got)
            self.tree.dec_lock_ref(last)
            return
        kv = torch.cat([prefix, own])[: len(tokens)]
        write_kv(self.kv, kv, tokens, start=prefix.numel())
        write_state(self.mamba, state, tokens)
        req = Req(list(tokens), None, kv, prefix, last, state)
        if keep_running and len(self.running) < 2:
            self.running.append(req)
        else:
            self.tree.cache_finished_req(req)

    @rule(tokens=tokens_st)
    def short_request(self, tokens):
        """A request that starts and ends at once (doubles how often requests are drawn)."""
        self.request(tokens, load_back=True, keep_running=False)

    @rule(index=st.integers(0, 1))
    def finish(self, index):
        if index < len(self.running):
            self.tree.cache_finished_req(self.running.pop(index))

    @rule(tokens=tokens_st)
    def match(self, tokens):
        self._match(tokens, load_back=True)

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        self.tree.evict(EvictParams(num_tokens=n))

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        self.tree.evict_host(n)

    @rule(n=st.integers(1, 2))
    def evict_mamba(self, n):
        self.tree.evict(EvictParams(mamba_num=n))

    @rule()
    def check_events(self):
        self.tree.check_hicache_events()

    @rule()
    def settle(self):
        self.tree.cache_controller.synchronize()
        self.tree.check_hicache_events()

    @invariant()
    def integrity(self):
        if hasattr(self, "tree"):
            self.tree.check_integrity(held_pages(self.tree, self.running),
                                      request_mamba_indices=[r.mamba_pool_idx for r in self.running])

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        try:
            for r in self.running:
                self.tree.cache_finished_req(r)
            self.tree.reset()
            assert self.alloc.available_size() == self.alloc.size
            assert self.mamba.available_size() == self.mamba.size
            for entry in self.stack.host_pool_group.entries:
                assert entry.host_pool.available_size() == entry.host_pool.size
        finally:
            self.stack.cache_controller.close()


HiMambaMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
TestHiMambaStateful = HiMambaMachine.TestCase


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
