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

Checkpoints: whenever a running request's computed tokens end on a page boundary (a prefill chunk
ends there, or decode crosses one), the scheduler caches its pages and ``checkpoint`` hands a copy
of its state to the tree's node ending there, so later requests (the next turn of a conversation)
hit at that boundary even when the request finishes mid-page.

The scheduler calls: ``reserve`` / ``unreserve`` around the prefix match at admission,
``bind_source`` after it, ``forward_slots`` for every batch, ``due_checkpoint`` / ``checkpoint``
after a forward, ``on_finished`` after ``cache_finished_req``, and ``check_integrity`` /
``tree_integrity_kwargs`` in its idle check.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.linear_attention import ZERO_STATE, StateSlots
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.radix.radix_key import RadixKey


class MambaStateSlots:
    def __init__(self, tree_cache, state_pool):
        self.tree = tree_cache
        self.pool = state_pool
        # HiMambaRadixCache keeps states in the tree and takes the request's slot on finish.
        self.tree_holds_states = tree_cache.supports_mamba() and not tree_cache.disable

    @classmethod
    def build(cls, tree_cache, runner) -> MambaStateSlots | None:
        """The manager for ``runner.state_pool``; None when the model has no state pool."""
        if runner.state_pool is None:
            return None
        if not tree_cache.disable and not tree_cache.supports_mamba():
            raise ValueError(f"{type(tree_cache).__name__} cannot cache the model's {runner.state_pool.kind.value} "
                             "states; use --enable-hierarchical-cache (HiMambaRadixCache) or --disable-radix-cache")
        return cls(tree_cache, runner.state_pool)

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
        return True

    def unreserve(self, req) -> None:
        """Undo ``reserve`` (the request was not admitted after all)."""
        if req.mamba_pool_idx is not None:
            self.pool.free(req.mamba_pool_idx)
            req.mamba_pool_idx = None

    def bind_source(self, req) -> None:
        """After the prefix match: the first forward starts from the matched prefix's state."""
        if req.prefix_indices.numel() == 0:
            req.mamba_src_idx = ZERO_STATE
            return
        state = getattr(req.last_node, "mamba_value", None)
        if state is None:
            raise CacheIntegrityError(
                f"request {req.rid}: matched {req.prefix_indices.numel()} cached tokens but the match's last node "
                "has no device state (the tree must end matches of state models at nodes with a state)")
        req.mamba_src_idx = int(state[0])

    # ---- forward -------------------------------------------------------------------------------
    def forward_slots(self, reqs) -> StateSlots:
        """Slots for a batch of ``reqs`` (batch order); afterwards each request continues from its own."""
        src = tuple(int(r.mamba_src_idx) for r in reqs)
        dst = tuple(int(r.mamba_pool_idx[0]) for r in reqs)
        for r in reqs:
            r.mamba_src_idx = int(r.mamba_pool_idx[0])
        return StateSlots(src, dst)

    # ---- checkpoints ---------------------------------------------------------------------------
    def due_checkpoint(self, req, page_size: int) -> bool:
        """The request's computed tokens end on a page boundary past its cached prefix, so the tree
        can take the state after them (a running request, after a forward)."""
        n = req.kv_len
        return self.tree_holds_states and n > 0 and n % page_size == 0 and n > req.prefix_indices.numel()

    def checkpoint(self, req) -> bool:
        """After ``tree.cache_unfinished_req(req)`` cached all of the request's (page-aligned)
        tokens: copy its running state into a free slot and give that to the tree as the state of
        the node ending there, so a later request matching this prefix resumes from it. Skipped
        (False) when the tokens are not all cached, the node has a state already, or no slot is
        free (a checkpoint never evicts)."""
        node = req.last_node
        if (not self.tree_holds_states or req.prefix_indices.numel() != req.kv_len or req.kv_len == 0
                or node is None or node.mamba_value is not None or self.pool.available_size() < 1):
            return False
        slot = self.pool.alloc(1)
        own = int(req.mamba_pool_idx[0])
        for buf in self.pool.buffers.values():
            buf[:, int(slot[0])] = buf[:, own]
        key = RadixKey(req.fill_ids, req.extra_key)
        # all present: adopts the state
        self.tree.insert(InsertParams(key=key, value=req.prefix_indices, chunked=True, mamba_value=slot))
        return node.mamba_value is not None

    # ---- finish --------------------------------------------------------------------------------
    def on_finished(self, req) -> None:
        """After ``tree.cache_finished_req(req)``: free the slot unless the tree took it."""
        if req.mamba_pool_idx is not None and not self.tree_holds_states:
            self.pool.free(req.mamba_pool_idx)
        req.mamba_pool_idx = None
        req.mamba_src_idx = ZERO_STATE

    # ---- integrity -----------------------------------------------------------------------------
    @staticmethod
    def request_slots(reqs) -> list[torch.Tensor]:
        return [r.mamba_pool_idx for r in reqs if r.mamba_pool_idx is not None]

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
