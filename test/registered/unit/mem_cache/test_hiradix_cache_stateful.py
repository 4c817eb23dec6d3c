"""Stateful test of HiRadixCache: random requests with shared prefixes, matches, locks, device
and host evictions, load-backs and partial event processing, across page sizes, write and
eviction policies. Every hit is checked byte for byte (KV is a function of the prefix), and
check_integrity() holds after every step; at the end every pool is back to full capacity.
Remembered matches (``match_reuse``) that still claim to be current must equal a fresh match
after every step, whatever happened to the tree in between."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tree_fixtures import assert_kv, held_pages, make_hicache, start_request

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix.match_reuse import match_prefix_reusing
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

# Few stems and suffixes, so whole requests recur (host hits need the evicted leaf again) and
# shared prefixes split nodes; an occasional random suffix keeps the shapes varied.
STEMS = [[], [5, 5, 1, 2], [5, 5, 1, 2, 3, 3, 0, 1]]
SUFFIXES = [[1], [2, 3], [1, 2, 3, 0], [3, 3, 3, 3, 2, 2], [0, 1, 0]]
suffix_st = st.one_of(st.sampled_from(SUFFIXES), st.lists(st.integers(0, 3), min_size=1, max_size=8))
tokens_st = st.tuples(st.sampled_from(STEMS), suffix_st).map(lambda t: t[0] + t[1])
extra_st = st.sampled_from([None, None, "tenant"])


class HiCacheMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction=st.sampled_from(["lru", "lfu"]),
        host_pages=st.sampled_from([6, 16]),
    )
    def setup(self, page_size, write_policy, eviction, host_pages):
        self.h = make_hicache(page_size=page_size, device_pages=12 // page_size * 2, host_pages=host_pages * 4 // page_size,
                              write_policy=write_policy, eviction_policy=eviction)
        self.pool = self.h.token_to_kv_pool_allocator.get_kvcache()
        self.running = []
        self.remembered = {}  # (tokens, extra) -> ReusableMatch

    # Draws never depend on the machine's state (what runs is decided after drawing), so a run
    # replays exactly even though how many acks a check finds depends on thread timing.
    @rule(tokens=tokens_st, extra=extra_st, load_back=st.booleans(), keep_running=st.booleans())
    def request(self, tokens, extra, load_back, keep_running):
        r = start_request(self.h, tokens, extra, load_back)
        if r is None:
            return
        assert_kv(self.pool, r.kv_indices, tokens, extra)
        if keep_running and len(self.running) < 3:
            self.running.append(r)
        else:
            self.h.cache_finished_req(r)

    @rule(tokens=tokens_st, extra=extra_st)
    def short_request(self, tokens, extra):
        """A request that starts and ends at once (doubles how often requests are drawn)."""
        self.request(tokens, extra, load_back=True, keep_running=False)

    @rule(index=st.integers(0, 2))
    def finish(self, index):
        if index < len(self.running):
            self.h.cache_finished_req(self.running.pop(index))

    @rule(index=st.integers(0, 2), chunked=st.booleans())
    def cache_unfinished(self, index, chunked):
        if index >= len(self.running):
            return
        r = self.running[index]
        self.h.cache_unfinished_req(r, chunked=chunked)
        assert_kv(self.pool, r.kv_indices, r.fill_ids, r.extra_key)

    @rule(tokens=tokens_st, extra=extra_st)
    def match_and_load(self, tokens, extra):
        m = self.h.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
        n = m.device_indices.numel()
        assert_kv(self.pool, m.device_indices, tokens[:n], extra)
        if not m.host_hit_length:
            return
        got = self.h.init_load_back(m.last_host_node, m.host_hit_length)
        if got is None:
            return
        assert got.numel() == m.host_hit_length
        self.h.ready_to_load_host_cache()
        self.h.cache_controller.load_lane.synchronize()
        assert_kv(self.pool, torch.cat([m.device_indices, got]), tokens[: n + got.numel()], extra)

    @rule(tokens=tokens_st, extra=extra_st)
    def remember_match(self, tokens, extra):
        slot = (tuple(tokens), extra)
        old = self.remembered.get(slot)
        key = old.key if old is not None else RadixKey(tokens, extra)
        self.remembered[slot] = match_prefix_reusing(self.h, key, old)

    @invariant()
    def remembered_matches_that_are_current_equal_a_fresh_match(self):
        for rec in getattr(self, "remembered", {}).values():
            if not rec.is_current(self.h):
                continue
            fresh, kept = self.h.match_prefix(MatchPrefixParams(key=rec.key)), rec.result
            assert fresh.path == kept.path
            assert torch.equal(fresh.device_indices, kept.device_indices)
            assert fresh.last_device_node is kept.last_device_node and fresh.last_host_node is kept.last_host_node
            assert fresh.host_hit_length == kept.host_hit_length
            assert rec.is_current(self.h)  # the fresh match changed nothing it depends on

    @rule(num_tokens=st.integers(1, 16))
    def evict(self, num_tokens):
        self.h.evict(EvictParams(num_tokens=num_tokens))

    @rule(num_tokens=st.integers(1, 16))
    def evict_host(self, num_tokens):
        self.h.evict_host(num_tokens)

    @rule()
    def check_events(self):
        self.h.check_hicache_events()

    @rule()
    def settle(self):
        self.h.cache_controller.synchronize()
        self.h.check_hicache_events()

    @invariant()
    def integrity(self):
        if hasattr(self, "h"):
            self.h.check_integrity(held_pages(self.h, self.running))

    def teardown(self):
        if not hasattr(self, "h"):
            return
        try:
            for r in self.running:
                self.h.cache_finished_req(r)
            self.running = []
            self.h.reset()
            host = self.h.cache_controller.mem_pool_host
            assert self.h.token_to_kv_pool_allocator.available_size() == self.h.token_to_kv_pool_allocator.size
            assert host.available_size() == host.size
        finally:
            self.h.cache_controller.close()


HiCacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
TestHiCacheStateful = HiCacheMachine.TestCase


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
