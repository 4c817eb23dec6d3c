"""Scheduler side of a model's own-slot state pool (Mamba / linear attention, e.g. Qwen3-Next).

Every admitted request owns one state slot (``req.mamba_pool_idx``, a 1-element int64 tensor) for
its running state, from admission until it finishes. Its first forward reads the incoming state
from ``req.mamba_src_idx``: ``ZERO_STATE`` when nothing is cached, else the state slot of the
prefix it matched (``req.last_node.mamba_value``; ``HiMambaRadixCache`` ends every match at a
node with a state, loading it back from host or storage with the KV). Every forward writes the
request's own slot, and later forwards (the next prefill chunk, decode) read it again, so chunked
prefill continues from the state the previous chunk left and the cached prefix's state is never
modified.

On finish the slot goes to the tree: ``HiMambaRadixCache.cache_finished_req`` keeps it as the
state of the request's page-aligned key or frees it. With the prefix cache disabled the slot is
simply freed. Slots are short only when the tree holds many states: ``reserve`` then evicts
unlocked tree states (``evict(EvictParams(mamba_num=1))``); with nothing evictable the request waits.

Checkpoints (states where later prefixes end). A prefill forward also yields the state at chosen
page-aligned positions inside it (``StateSlots.track``; the layer splits the request's tokens there):
every ``track_interval`` tokens (upstream's ``--mamba-track-interval``), the position where the
request's prompt left the tree's KV (its branch point: a shared system prompt), and the last page
boundary before the forward's end (so the next turn of a conversation, whose prompt extends this
one's, hits even when this forward ends mid-page). Each goes to a free state slot, kept pending on
``req.mamba_checkpoints`` as ``(position, slot)`` until the request's pages are in the tree:
``checkpoint`` (after ``cache_unfinished_req``) or the tree's ``cache_finished_req`` inserts them.
When a forward ends on a page boundary (a prefill chunk ends there, or decode reaches a multiple of
the track interval), ``checkpoint`` also hands a copy of the running state to the node ending there.
Checkpoints never evict more than one tree state each, and the tree evicts them like any state.
The pool has one slot per running request plus a share for checkpoints
(``model_executor/state_pool_size.py``: ``--max-mamba-cache-size``, ``--mamba-full-memory-ratio``);
when it is short, a checkpoint evicts the least recently used tree state or is skipped
(``checkpoints_skipped``), never a request. ``stats`` counts the slots by holder.

The scheduler calls: ``reserve`` / ``unreserve`` around the prefix match at admission,
``bind_source`` after it, ``forward_slots`` for every batch, ``due_checkpoint`` / ``checkpoint``
after a forward, ``on_finished`` after ``cache_finished_req``, and ``check_integrity`` /
``tree_integrity_kwargs`` in its idle check.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sglang.srt.layers.linear_attention import ZERO_STATE, StateSlots
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, request_priority
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.radix.mamba_checkpoints import insert_request_checkpoints
from sglang.srt.mem_cache.radix.radix_key import RadixKey, common_prefix_len

DEFAULT_TRACK_INTERVAL = 256  # upstream's --mamba-track-interval default


class MambaStateSlots:
    def __init__(self, tree_cache, state_pool, track_interval: int = DEFAULT_TRACK_INTERVAL):
        if track_interval < 1:
            raise ValueError(f"track_interval must be >= 1, got {track_interval}")
        self.tree = tree_cache
        self.pool = state_pool
        # HiMambaRadixCache keeps states in the tree and takes the request's slot on finish.
        self.tree_holds_states = tree_cache.supports_mamba() and not tree_cache.disable
        self.page_size = getattr(tree_cache, "page_size", 1)
        self.track_interval = math.lcm(track_interval, self.page_size)  # checkpoints are page-aligned
        self.checkpoints_skipped = 0  # checkpoints not taken: no slot free and no tree state evictable

    @classmethod
    def build(cls, tree_cache, runner, track_interval: int = DEFAULT_TRACK_INTERVAL) -> MambaStateSlots | None:
        """The manager for ``runner.state_pool``; None when the model has no state pool."""
        if runner.state_pool is None:
            return None
        if not tree_cache.disable and not tree_cache.supports_mamba():
            raise ValueError(f"{type(tree_cache).__name__} cannot cache the model's {runner.state_pool.kind.value} "
                             "states; use --enable-hierarchical-cache (HiMambaRadixCache) or --disable-radix-cache")
        return cls(tree_cache, runner.state_pool, track_interval)

    # ---- admission -----------------------------------------------------------------------------
    def reserve(self, req) -> bool:
        """Give ``req`` its own state slot, evicting unlocked tree states when none is free.
        False (nothing held) when no slot can be had now."""
        if self.pool.available_size() < 1 and self.tree_holds_states:
            self.tree.evict(EvictParams(mamba_num=1))
        slot = self.pool.alloc(1)
        if slot is None:
            return False
        req.mamba_pool_idx = slot.to(device="cpu", dtype=torch.int64).reshape(1)
        req.mamba_src_idx = ZERO_STATE
        req.mamba_checkpoints = []
        return True

    def unreserve(self, req) -> None:
        """Undo ``reserve`` (the request was not admitted after all)."""
        if req.mamba_pool_idx is not None:
            self.pool.free(req.mamba_pool_idx)
            req.mamba_pool_idx = None

    def bind_source(self, req) -> None:
        """After the prefix match: the first forward starts from the matched prefix's state.
        Also notes where the prompt leaves the tree's KV (``req.mamba_branch_len``, tokens), a
        position later requests sharing this prefix will want a state at."""
        req.mamba_computed_len = int(req.prefix_indices.numel())
        req.mamba_branch_len = self._kv_match_len(req) if self.tree_holds_states else 0
        if req.prefix_indices.numel() == 0:
            req.mamba_src_idx = ZERO_STATE
            return
        state = getattr(req.last_node, "mamba_value", None)
        if state is None:
            raise CacheIntegrityError(
                f"request {req.rid}: matched {req.prefix_indices.numel()} cached tokens but the match's last node "
                "has no device state (the tree must end matches of state models at nodes with a state)")
        req.mamba_src_idx = int(state[0])

    def _kv_match_len(self, req) -> int:
        """Page-aligned tokens of the prompt the tree holds KV for below ``req.last_node`` (no
        state needed), found by a read-only walk (the match stopped at the last state)."""
        ids = np.asarray(req.origin_input_ids[:-1], dtype=np.int64)
        key, P = RadixKey(ids, req.extra_key), self.page_size
        node, pos = req.last_node, int(req.prefix_indices.numel())
        while node is not None and pos + P <= len(key):
            child = node.children.get(key.child_key(pos, P))
            if child is None or child.value is None:
                break
            n = common_prefix_len(child.key.ids, key.ids[pos:], P)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    # ---- forward -------------------------------------------------------------------------------
    def _track_positions(self, req, start: int, end: int) -> list[int]:
        """Page-aligned positions strictly inside (start, end) to checkpoint: multiples of the
        track interval, the branch point, and the last page boundary before ``end``."""
        first = (start // self.track_interval + 1) * self.track_interval
        points = set(range(first, end, self.track_interval))
        branch = getattr(req, "mamba_branch_len", 0)
        if start < branch < end:
            points.add(branch)
        last = (end - 1) // self.page_size * self.page_size
        if start < last:
            points.add(last)
        return sorted(points)

    def _most_useful_first(self, req, positions: list[int], end: int) -> list[int]:
        """``positions`` in the order slots go to them when the pool is short: the last page
        boundary (the conversation's next turn extends this prompt), the branch point (a prefix
        other requests share), then the interval positions deepest first (a deeper hit saves more)."""
        last = (end - 1) // self.page_size * self.page_size
        branch = getattr(req, "mamba_branch_len", 0)
        return sorted(positions, key=lambda pos: (pos != last, pos != branch, -pos))

    def _take_slot(self) -> torch.Tensor | None:
        """A free state slot for a checkpoint, evicting at most one unlocked tree state; None when
        none can be had (the checkpoint is skipped)."""
        if self.pool.available_size() < 1:
            self.tree.evict(EvictParams(mamba_num=1))
        slot = self.pool.alloc(1)
        self.checkpoints_skipped += slot is None
        return slot

    def forward_slots(self, reqs) -> StateSlots:
        """Slots for a batch of ``reqs`` (batch order), called once their new tokens are in
        ``kv_indices``; afterwards each request continues from its own. Prefill tokens also get
        checkpoints (``_track_positions``), pending on ``req.mamba_checkpoints``."""
        src = tuple(int(r.mamba_src_idx) for r in reqs)
        dst = tuple(int(r.mamba_pool_idx[0]) for r in reqs)
        track = []
        for r in reqs:
            r.mamba_src_idx = int(r.mamba_pool_idx[0])
            start, end = getattr(r, "mamba_computed_len", r.kv_len - 1), r.kv_len
            r.mamba_computed_len = end
            points = []
            tracking = self.tree_holds_states and getattr(r, "mamba_checkpoints", None) is not None
            for pos in self._most_useful_first(r, self._track_positions(r, start, end), end) if tracking else ():
                slot = self._take_slot()
                if slot is None:
                    break
                r.mamba_checkpoints.append((pos, slot.to(device="cpu", dtype=torch.int64).reshape(1)))
                points.append((pos - start, int(slot[0])))
            track.append(tuple(sorted(points)))
        return StateSlots(src, dst, tuple(track) if any(track) else ())

    # ---- checkpoints ---------------------------------------------------------------------------
    def due_checkpoint(self, req, page_size: int) -> bool:
        """Decode reached a multiple of the track interval (a multiple of ``page_size``) past the
        request's cached prefix, so the tree can take the state after it (after a forward)."""
        n = req.kv_len
        return (self.tree_holds_states and n > 0 and n % page_size == 0 and n % self.track_interval == 0
                and n > req.prefix_indices.numel())

    def checkpoint(self, req) -> bool:
        """After ``tree.cache_unfinished_req(req)`` cached the request's whole pages: give the
        tree its pending checkpoints inside them, and, when those pages are all it computed, a
        copy of its running state for the node ending there, so a later request matching these
        prefixes resumes from them. The copy is skipped (False) when the tokens are not all
        cached, the node has a state already, or no slot is free (it never evicts)."""
        if not self.tree_holds_states:
            return False
        insert_request_checkpoints(self.tree, req, RadixKey(req.fill_ids, req.extra_key), True, self.pool.free)
        node = req.last_node
        if (req.prefix_indices.numel() != req.kv_len or req.kv_len == 0
                or node is None or node.mamba_value is not None or self.pool.available_size() < 1):
            return False
        slot = self.pool.alloc(1)
        own = int(req.mamba_pool_idx[0])
        for buf in self.pool.buffers.values():
            buf[:, int(slot[0])] = buf[:, own]
        key = RadixKey(req.fill_ids, req.extra_key)
        # all present: adopts the state
        self.tree.insert(InsertParams(key=key, value=req.prefix_indices, chunked=True, mamba_value=slot,
                                      priority=request_priority(req)))
        return node.mamba_value is not None

    # ---- finish --------------------------------------------------------------------------------
    def on_finished(self, req) -> None:
        """After ``tree.cache_finished_req(req)``: free the slot unless the tree took it."""
        if req.mamba_pool_idx is not None and not self.tree_holds_states:
            self.pool.free(req.mamba_pool_idx)
        for _, slot in getattr(req, "mamba_checkpoints", ()):  # not taken by the tree (an abort)
            self.pool.free(slot)
        req.mamba_checkpoints = []
        req.mamba_pool_idx = None
        req.mamba_src_idx = ZERO_STATE

    # ---- figures -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """State slots by holder, read now (units: slots): ``capacity_slots``, ``free_slots``,
        ``checkpoint_slots`` (device states the prefix cache keeps: evicted LRU when requests
        need slots), ``running_slots`` (requests' own slots and their pending checkpoints), the
        counter ``checkpoints_skipped``; with HiCache ``host_capacity_slots`` / ``host_used_slots``
        (the host state pool)."""
        capacity, free = self.pool.size, self.pool.available_size()
        tree = sum(n.mamba_value is not None for n in self.tree._all_nodes()) if self.tree_holds_states else 0
        out = {"capacity_slots": capacity, "free_slots": free, "checkpoint_slots": tree,
               "running_slots": capacity - free - tree, "checkpoints_skipped": self.checkpoints_skipped}
        binding = getattr(getattr(self.tree, "cache_controller", None), "bindings", {}).get(PoolName.MAMBA)
        if binding is not None:
            host = binding.host_alloc
            out["host_capacity_slots"] = host.size
            out["host_used_slots"] = host.size - host.available_size()
        return out

    # ---- integrity -----------------------------------------------------------------------------
    @staticmethod
    def request_slots(reqs) -> list[torch.Tensor]:
        """State slots requests hold: their own and their pending checkpoints."""
        own = [r.mamba_pool_idx for r in reqs if r.mamba_pool_idx is not None]
        return own + [slot for r in reqs for _, slot in getattr(r, "mamba_checkpoints", ())]

    def tree_integrity_kwargs(self, held_reqs) -> dict:
        """Extra arguments of ``tree.check_integrity``: the state slots requests hold."""
        return {"request_mamba_indices": self.request_slots(held_reqs)} if self.tree_holds_states else {}

    def check_integrity(self, held_reqs) -> None:
        """Without a state-holding tree: every state slot is free or held by exactly one request."""
        if self.tree_holds_states:
            return  # the tree's check_integrity covers both Mamba pools
        held = self.request_slots(held_reqs)
        slots = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        if slots.numel() != torch.unique(slots).numel():
            raise CacheIntegrityError(f"mamba pool: a state slot is held by two requests: {slots.tolist()}")
        free = self.pool.available_size()
        if free + slots.numel() != self.pool.size:
            raise CacheIntegrityError(f"mamba pool: free {free} + held by requests {slots.numel()} != capacity "
                                      f"{self.pool.size}")

