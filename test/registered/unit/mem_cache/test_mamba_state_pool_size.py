"""The state pool of a state model: sized for running requests plus a checkpoint share
(``model_executor/state_pool_size.py``: upstream's ``--max-mamba-cache-size`` and
``--mamba-full-memory-ratio``), and, when smaller than the checkpoints a workload wants, still
serving every request: checkpoints are evicted LRU or skipped, counted (``MambaStateSlots.stats``),
and never more than the pool minus the running requests' slots (issue 28)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sglang.srt.managers.mamba_state import MambaStateSlots
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_mamba_hybrid_stack
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.mamba import MambaPool
from sglang.srt.mem_cache.radix.radix_key import RadixKey
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.srt.model_executor.state_pool_size import StatePoolSize
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

PAGE, KV_TOKENS, RUNNING = 4, 512, 2


# ---- sizing ----------------------------------------------------------------------------------------
def test_default_pool_is_running_slots_plus_a_checkpoint_share_of_the_kv_bytes():
    size = StatePoolSize(max_running_requests=8)  # ratio 0.9, upstream's default
    # KV pool 1024 tokens x 100 B; a state 1000 B: 0.9 x 102400 / 1000 = 92 checkpoints
    assert size.checkpoint_slots(1024, 100, 4, 1000) == 92
    assert size.num_slots(1024, 100, 4, 1000) == 8 + 92
    # a state per KV page at most (1024 / 16 = 64): more could never be in the tree
    assert size.num_slots(1024, 100, 16, 100) == 8 + 64
    assert StatePoolSize(8, mamba_full_memory_ratio=0.0).num_slots(1024, 100, 16, 1000) == 8
    assert StatePoolSize(8, prefix_cache=False).num_slots(1024, 100, 16, 1000) == 8  # nothing is cached
    assert StatePoolSize(8, max_mamba_cache_size=5).num_slots(1024, 100, 16, 1000) == 5  # upstream's: in all


def test_memory_budget_split_between_kv_and_states():
    size = StatePoolSize(max_running_requests=8)
    budget = 1_000_000
    for page, share_of_kv in ((4, 0.9), (16, 1000 / 16 / 100)):  # the ratio; a state a page binds
        tokens = size.kv_tokens(budget, 100, page, 1000)
        slots = size.num_slots(tokens, 100, page, 1000)
        used = tokens * 100 + (slots + 1) * 1000  # +1: the pool's reserved slot
        assert used <= budget < used + 100 + 2 * 1000, page  # the budget is spent, within a token and a slot
        assert slots - 8 == pytest.approx(share_of_kv * tokens * 100 / 1000, abs=1), page
    fixed = StatePoolSize(8, max_mamba_cache_size=50)
    assert fixed.kv_tokens(budget, 100, 16, 1000) == (budget - 51 * 1000) // 100


def test_flags_reach_the_runner_and_are_checked():
    args = ServerArgs(model_path="m", max_mamba_cache_size=6, mamba_full_memory_ratio=0.5, disable_radix_cache=True)
    from sglang.srt.managers.scheduler import runner_config

    size = runner_config(args).state_pool_size
    assert (size.max_mamba_cache_size, size.mamba_full_memory_ratio, size.prefix_cache) == (6, 0.5, False)
    with pytest.raises(ValueError, match="--max-mamba-cache-size 0 is invalid; must be unset or an integer >= 1"):
        ServerArgs(model_path="m", max_mamba_cache_size=0)
    with pytest.raises(ValueError, match="--mamba-full-memory-ratio -1.0 is invalid; must be a number >= 0"):
        ServerArgs(model_path="m", mamba_full_memory_ratio=-1.0)
    with pytest.raises(ValueError, match="max_mamba_cache_size=0 is invalid"):
        ModelRunnerConfig("m", max_mamba_cache_size=0)


# ---- a pool smaller than the checkpoints a workload wants -------------------------------------------
@dataclass
class Req:
    """What MambaStateSlots and the tree read of a scheduler request."""

    rid: str
    origin_input_ids: list
    extra_key: object = None
    fill_ids: list = field(default_factory=list)
    kv_indices: torch.Tensor = None
    prefix_indices: torch.Tensor = None
    last_node: object = None
    mamba_pool_idx: torch.Tensor = None
    mamba_src_idx: int = 0
    mamba_checkpoints: list = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        return len(self.fill_ids)


def _mamba_pool(slots: int) -> MambaPool:
    return MambaPool(slots, [(2, 3)], (1, 2, 2), 1, conv_dtype=torch.float32)


def _plain_tree(states: MambaPool):
    alloc = PagedTokenToKVPoolAllocator(KV_TOKENS, PAGE)
    return MambaRadixCache(CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=alloc), states)


def _hicache_tree(states: MambaPool):
    kv = MHATokenToKVPool(KV_TOKENS, PAGE, torch.float32, 1, 2, 1)
    alloc = PagedTokenToKVPoolAllocator(KV_TOKENS, PAGE, kvcache=kv)
    params = CacheInitParams(page_size=PAGE, token_to_kv_pool_allocator=alloc)
    return build_mamba_hybrid_stack(params, states, HiCacheConfig(io_backend="direct", hicache_ratio=2)).tree_cache


class Serving:
    """The scheduler's calls around a batch of requests, without a model: admission (reserve, match,
    lock, bind), one prefill forward's slots, decode steps' slots and decode checkpoints, finish."""

    def __init__(self, tree, states: MambaPool):
        self.tree, self.states = tree, states
        self.slots = MambaStateSlots(tree, states, track_interval=PAGE)  # a checkpoint every page
        self.alloc = tree.token_to_kv_pool_allocator
        self.max_checkpoints = 0
        self.wanted = self.taken = 0  # checkpoints the forwards asked for / took (a state slot each)

    def admit(self, req: Req) -> None:
        assert self.slots.reserve(req), f"{req.rid}: no state slot"
        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids[:-1])))
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        self.tree.inc_lock_ref(req.last_node)
        self.slots.bind_source(req)
        req.kv_indices = req.prefix_indices.clone()
        req.fill_ids = list(req.origin_input_ids[:req.prefix_indices.numel()])

    def _extend(self, req: Req, tokens: list) -> None:
        """Slots for ``tokens``: the rest of the request's last page, then fresh pages."""
        slots = req.kv_indices.tolist()
        for _ in tokens:
            if len(slots) % PAGE:
                slots.append(slots[-1] + 1)
                continue
            if self.alloc.available_size() < PAGE:
                self.tree.evict(EvictParams(num_tokens=PAGE))
            page = self.alloc.alloc(PAGE)
            assert page is not None, "KV pool short"
            slots.append(int(page[0]))
        req.kv_indices = torch.tensor(slots, dtype=torch.int64)
        req.fill_ids = req.fill_ids + list(tokens)

    def forward(self, reqs: list[Req], new_tokens: dict) -> None:
        for r in reqs:
            self._extend(r, new_tokens[r.rid])
        before = sum(len(r.mamba_checkpoints) for r in reqs)
        self.wanted += sum(len(self.slots._track_positions(r, r.mamba_computed_len, r.kv_len)) for r in reqs)
        self.slots.forward_slots(reqs)
        self.taken += sum(len(r.mamba_checkpoints) for r in reqs) - before
        for r in reqs:  # decode reached a checkpoint position: the tree takes the state there
            if self.slots.due_checkpoint(r, PAGE):
                self.tree.cache_unfinished_req(r)
                self.slots.checkpoint(r)
        self.check(reqs)

    def finish(self, req: Req) -> None:
        self.tree.cache_finished_req(req)
        self.slots.on_finished(req)

    def check(self, running: list[Req]) -> None:
        stats = self.slots.stats()
        own = [r for r in running if r.mamba_pool_idx is not None]
        assert stats["capacity_slots"] == self.states.size
        assert stats["free_slots"] + stats["running_slots"] + stats["checkpoint_slots"] == self.states.size
        assert stats["running_slots"] == len(own) + sum(len(r.mamba_checkpoints) for r in own)
        assert stats["checkpoint_slots"] <= self.states.size - len(own)  # bounded by the pool, less running
        self.max_checkpoints = max(self.max_checkpoints, stats["checkpoint_slots"])
        pages = []
        for r in own:  # the whole pages each request holds beyond its cached prefix
            mine = torch.unique(r.kv_indices[r.prefix_indices.numel():] // PAGE)
            pages.append((mine.view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1))
        self.tree.check_integrity(pages, **self.slots.tree_integrity_kwargs(own))


def _prompt(gen, n):
    return torch.randint(5, 1000, (n,), generator=gen).tolist()


@pytest.mark.parametrize("tree", ["plain", "hicache"])
def test_a_pool_smaller_than_the_checkpoints_wanted_serves_every_request(tree):
    """Pairs of conversations sharing a 32-token system prompt, three rounds each, a checkpoint
    wanted at every page (~12 a prefill); the pool has 2 running slots + 2: every request runs
    to the end, the checkpoints are evicted LRU, and their count stays <= the pool less the
    running requests' slots (checked after every forward)."""
    states = _mamba_pool(StatePoolSize(RUNNING, max_mamba_cache_size=RUNNING + 2).num_slots(KV_TOKENS, 64, PAGE, 64))
    serving = Serving(_plain_tree(states) if tree == "plain" else _hicache_tree(states), states)
    gen = torch.Generator().manual_seed(5)
    system = _prompt(gen, 32)
    histories = {c: system + _prompt(gen, 14 + c) for c in range(4)}
    served = 0
    for _round in range(3):
        for pair in ((0, 1), (2, 3)):
            reqs = [Req(f"c{c}r{_round}", histories[c]) for c in pair]
            for r in reqs:
                serving.admit(r)
            serving.forward(reqs, {r.rid: r.origin_input_ids[len(r.fill_ids):] for r in reqs})
            for step in range(6):  # decode: 6 answer tokens each
                serving.forward(reqs, {r.rid: [7 + step] for r in reqs})
            for c, r in zip(pair, reqs):
                serving.finish(r)
                histories[c] = r.fill_ids + _prompt(gen, 9)  # the next round's prompt extends this one
                served += 1
            serving.check([])
            if getattr(serving.tree, "cache_controller", None) is not None:
                serving.tree.cache_controller.synchronize()
                serving.tree.check_hicache_events()
    stats = serving.slots.stats()
    assert served == 12
    assert serving.wanted > 20 * states.size  # far more checkpoints than the pool holds
    assert serving.taken > states.size - RUNNING  # the checkpoint share was reused: tree states evicted
    assert 0 < stats["checkpoints_skipped"] < serving.wanted  # the rest: skipped, counted
    assert serving.max_checkpoints <= states.size  # checked against running slots after every forward
    assert stats["free_slots"] + stats["checkpoint_slots"] == states.size  # nothing leaked
    if tree == "hicache":
        assert stats["host_capacity_slots"] == 2 * states.size and 0 <= stats["host_used_slots"] <= 2 * states.size


def test_a_short_pool_keeps_the_checkpoint_the_next_turn_hits():
    """One slot for checkpoints and eleven page positions wanted: it goes to the last page of the
    prompt, so the conversation's next turn resumes there (not at the first page)."""
    states = _mamba_pool(2)  # the request's own slot + one
    serving = Serving(_plain_tree(states), states)
    gen = torch.Generator().manual_seed(7)
    first = Req("t1", _prompt(gen, 46))
    serving.admit(first)
    serving.forward([first], {"t1": first.origin_input_ids})
    assert [pos for pos, _ in first.mamba_checkpoints] == [44]
    serving.finish(first)
    second = Req("t2", first.fill_ids + _prompt(gen, 9))
    serving.admit(second)
    assert second.prefix_indices.numel() == 44
    serving.forward([second], {"t2": second.origin_input_ids[44:]})
    serving.finish(second)


def test_state_slots_on_metrics():
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from sglang.srt.metrics.collector import _Families, _mamba_families

    states = _mamba_pool(4)
    serving = Serving(_hicache_tree(states), states)
    req = Req("m1", _prompt(torch.Generator().manual_seed(8), 22))
    serving.admit(req)
    serving.forward([req], {"m1": req.origin_input_ids})  # own slot + 3 checkpoints (20, 16, 12)
    families = _Families("tiny")
    _mamba_families(families, serving.slots.stats())

    class Collector:
        def collect(self):
            return families.out

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    for line in ('sglang:mamba_used_tokens{model_name="tiny"} 4.0', 'sglang:mamba_available_tokens{model_name="tiny"} 0.0',
                 'sglang:mamba_evictable_tokens{model_name="tiny"} 0.0', 'sglang:mamba_usage{model_name="tiny"} 1.0',
                 'sglang:mamba_checkpoints_skipped_total{model_name="tiny"} 1.0',
                 'sglang:hicache_host_mamba_total_states{model_name="tiny"} 8.0'):
        assert line in text, line
    serving.finish(req)
    stats = serving.slots.stats()
    assert (stats["checkpoint_slots"], stats["running_slots"]) == (3, 0)  # the tree took the checkpoints
