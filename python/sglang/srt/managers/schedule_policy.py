"""SchedulePolicy and PrefillAdder: in which order waiting requests are tried, and which of
them join the next prefill batch with how many tokens each.

Order (``--schedule-policy``, ``WaitingQueueOrder``): ``fcfs`` keeps arrival order; ``lpm``
puts the longest cached prefix (device + host) first; ``lof`` the largest ``max_new_tokens``
first; ``random`` shuffles with a seeded generator (the same on every TP rank). Sorts are
stable, so ties keep arrival order. ``lpm`` reads each request's match through
``match_reuse``, so ordering costs one check per walked node while the tree is unchanged.

Admission, in that order, within a token budget (``--chunked-prefill-size``): the continuing
chunked request goes first, then waiting requests until the budget, the request table or
device memory runs out. At most one request is left part-prefilled.

Memory rule (units: device token slots). A request reserves, at admission, every page it can
ever need: its prompt plus ``(max_new_tokens - 1) * conservativeness`` decode tokens past its
cached prefix (``--schedule-conservativeness`` >= 1, capped at the pool). It is admitted only
when ``free + evictable - reserved_by_others`` covers that plus its load-back, so decode never
runs out and nothing is ever retracted. Host hits are loaded back (``init_load_back``) only
for requests admitted here, so every load starts with the batch that needs it.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from sglang.srt.choice_enum import ChoiceEnum
from sglang.srt.managers.schedule_batch import Req, num_pages
from sglang.srt.mem_cache.radix.match_reuse import match_prefix_reusing
from sglang.srt.mem_cache.base_prefix_cache import MatchResult

logger = logging.getLogger(__name__)


class SchedulePolicy(ChoiceEnum):
    FCFS = "fcfs"
    LPM = "lpm"
    LOF = "lof"
    RANDOM = "random"


def match_request(tree, req: Req) -> MatchResult:
    """The tree's match of ``req.prompt_key``, reused from the request's last one while current."""
    req.cached_match = match_prefix_reusing(tree, req.prompt_key, req.cached_match)
    return req.cached_match.result


class WaitingQueueOrder:
    """Reorders the waiting queue before each admission round (in place, stable)."""

    def __init__(self, policy, tree_cache, seed: int = 0):
        self.policy = SchedulePolicy.parse(policy)
        self.tree_cache = tree_cache
        self._rng = random.Random(seed)

    def _cached_tokens(self, req: Req) -> int:
        m = match_request(self.tree_cache, req)
        return int(m.device_indices.numel()) + m.host_hit_length

    def apply(self, waiting: deque) -> None:
        if self.policy is SchedulePolicy.FCFS or len(waiting) < 2:
            return
        reqs = list(waiting)
        if self.policy is SchedulePolicy.LPM:
            reqs.sort(key=lambda r: -self._cached_tokens(r))
        elif self.policy is SchedulePolicy.LOF:
            reqs.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        else:
            self._rng.shuffle(reqs)
        waiting.clear()
        waiting.extend(reqs)


class AddResult(Enum):
    ADDED = "added"
    NO_MEMORY = "no_memory"  # stop admitting: later requests wait too (FCFS)
    NO_ROOM = "no_room"  # token budget or request table exhausted
    PREFETCHING = "prefetching"  # its L3 prefetch is still running: skip it this step


@dataclass
class PrefillAdder:
    tree_cache: object
    allocator: object  # token_to_kv_pool_allocator
    req_to_token_pool: object
    page_size: int
    token_budget: int  # new prompt tokens this batch may compute
    reserved_tokens: int  # slots still reserved by requests admitted earlier
    storage_enabled: bool = False
    conservativeness: float = 1.0  # scales the decode tokens a request reserves (>= 1)
    max_reserve_tokens: int = 1 << 62  # a reservation never exceeds this (the device pool)
    mamba: object = None  # mamba_state.MambaStateSlots when the model has a state pool
    entries: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens to compute now)
    chunked: Req | None = None  # the request left part-prefilled after this batch

    def _chunk(self, req: Req) -> int:
        """Tokens of ``req`` to compute in this batch (page-aligned when the prompt is cut)."""
        n = min(req.prefill_remaining, self.token_budget)
        if n < req.prefill_remaining and n >= self.page_size:
            n = n // self.page_size * self.page_size
        return n

    def add_chunked(self, req: Req) -> None:
        n = self._chunk(req)
        self.entries.append((req, n))
        self.token_budget -= n
        self.chunked = req if n < req.prefill_remaining else None

    def _room(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved_tokens

    def try_add(self, req: Req) -> AddResult:
        if self.token_budget <= 0 or self.req_to_token_pool.available_size() == 0:
            return AddResult.NO_ROOM
        if self.chunked is not None and req.prefill_remaining > self.token_budget:
            return AddResult.NO_ROOM  # it would be a second part-prefilled request
        tree = self.tree_cache
        if self.storage_enabled and not tree.check_prefetch_progress(req.rid):
            return AddResult.PREFETCHING
        if self.mamba is not None and not self.mamba.reserve(req):
            return AddResult.NO_MEMORY  # no state slot free and none evictable
        if not self._match_and_lock(req):
            if self.mamba is not None:
                self.mamba.unreserve(req)
            return AddResult.NO_MEMORY
        if self.mamba is not None:
            self.mamba.bind_source(req)
        req.req_pool_idx = self.req_to_token_pool.alloc(1)[0]
        if req.prefix_indices.numel():
            self.req_to_token_pool.write((req.req_pool_idx, slice(0, req.prefix_indices.numel())), req.prefix_indices)
        self.reserved_tokens += req.max_pages * self.page_size
        n = self._chunk(req)
        self.entries.append((req, n))
        self.token_budget -= n
        if n < req.prefill_remaining:
            self.chunked = req
        return AddResult.ADDED

    def _kv_total(self, req: Req) -> int:
        """Tokens the request reserves KV for: prompt plus scaled decode (units: tokens)."""
        prompt, decode = len(req.origin_input_ids), max(req.sampling_params.max_new_tokens - 1, 0)
        needed = prompt + decode
        if self.conservativeness == 1.0:
            return needed
        scaled = prompt + math.ceil(decode * self.conservativeness)
        return max(min(scaled, self.max_reserve_tokens), needed)

    def _match_and_lock(self, req: Req) -> bool:
        """Match the prompt (all but its last token), load host hits back when they fit, lock
        the prefix and reserve the request's pages. False (nothing held) when memory is short."""
        tree, P = self.tree_cache, self.page_size
        kv_total = self._kv_total(req)
        m = match_request(tree, req)
        prefix, last_node = m.device_indices, m.last_device_node
        tree.inc_lock_ref(last_node)
        host = 0
        if m.host_hit_length:
            need = num_pages(kv_total - prefix.numel() - m.host_hit_length, P) * P
            room = self._room()
            if room >= need + m.host_hit_length:
                loaded = tree.init_load_back(m.last_host_node, m.host_hit_length, mem_quota=room - need)
                if loaded is not None and loaded.numel():
                    tree.inc_lock_ref(m.last_host_node)
                    tree.dec_lock_ref(last_node)
                    prefix, last_node, host = torch.cat([prefix, loaded]), m.last_host_node, loaded.numel()
        own_pages = num_pages(kv_total - prefix.numel(), P)
        if own_pages * P > self._room():
            tree.dec_lock_ref(last_node)
            return False
        loaded = tree.pop_prefetch_loaded_tokens(req.rid) if self.storage_enabled else 0
        storage = min(loaded, host)
        if loaded > storage:  # prefetched tokens not reused: upstream's unfulfilled storage hits
            tree.count_prefetch_admission_shortfall(loaded - storage)
        req.prefix_indices, req.kv_indices, req.last_node = prefix, prefix.clone(), last_node
        req.max_pages, req.pages_allocated = own_pages, 0
        req.cached_match = None  # admitted: no longer matched while waiting
        req.set_cached(device=int(m.device_indices.numel()), host=host - storage, storage=storage)
        return True
