"""MambaRadixCache: the device-only prefix cache of state models (attention KV + Mamba state).

Upstream's name for the tree a state model (Qwen3-Next) gets without ``--enable-hierarchical-cache``.
A prefix is reusable only where the state after it is known, so a node may carry one device state
(``mamba_value``, a slot of the model runner's ``MambaPool``). A match ends at the deepest matched node
with a state; ``last_device_node.mamba_value`` is then the state the request resumes from. The states
come from the request's own slot on finish (when its tokens end on a page) and from checkpoints
(``managers/mamba_state.py``): inside a prefill forward, at the end of a chunk, during decode.

Eviction takes unlocked leaves in policy order; a leaf's KV and state leave together, so a
request short of a state slot (``EvictParams(mamba_num=...)``) evicts the least recently used
cached prefixes. The host-tier tree is ``HiMambaRadixCache``.
"""

from __future__ import annotations

import heapq
import logging

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchResult,
    request_priority,
)
from sglang.srt.mem_cache.radix.integrity import check_slot_partition
from sglang.srt.mem_cache.radix.mamba_checkpoints import insert_request_checkpoints
from sglang.srt.mem_cache.radix.tree_node import TreeNode, empty_indices
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.utils import as_cpu_index

logger = logging.getLogger(__name__)


class MambaRadixCache(RadixCache):
    def __init__(self, params, mamba_pool):
        self.mamba_pool = mamba_pool  # MambaPool: alloc / free / allocator
        self._pending_mamba: torch.Tensor | None = None
        super().__init__(params)

    def supports_mamba(self) -> bool:
        return True

    def _free_node_slots(self, node: TreeNode) -> None:
        super()._free_node_slots(node)
        if node.mamba_value is not None:
            self.mamba_pool.free(node.mamba_value)
            node.mamba_value = None

    # ---- match and insert --------------------------------------------------------------------
    def _match_result(self, path: list[TreeNode]) -> MatchResult:
        """The match ends at the deepest node with a state (the root on a miss)."""
        end = len(path)
        while end and path[end - 1].mamba_value is None:
            end -= 1
        path = path[:end]
        device = torch.cat([n.value for n in path]) if path else empty_indices()
        last = path[-1] if path else self.root_node
        return MatchResult(device, last, last, 0)

    def insert(self, params: InsertParams) -> InsertResult:
        """RadixCache.insert, plus ``params.mamba_value``: a device state slot (1 element) holding
        the state after the key's whole pages. The tree takes it: kept by the node ending at the
        key when that node has no state yet, freed otherwise (also when the tree is disabled)."""
        slot = params.mamba_value
        if slot is not None:
            slot = as_cpu_index(slot, "mamba_value")
            if slot.numel() != 1:
                raise ValueError(f"mamba_value must be one slot, got {slot.numel()}")
            if len(params.key) % self.page_size:
                raise ValueError(f"insert with a mamba_value needs whole pages: the key has {len(params.key)} "
                                 f"tokens, page_size {self.page_size}")
            if self.disable:
                self.mamba_pool.free(slot)
                slot = None
        self._pending_mamba = slot
        try:
            return super().insert(params)
        finally:
            if self._pending_mamba is not None:  # the insert failed before adopting it
                self._pending_mamba = None

    def _on_inserted(self, touched, chunked) -> None:
        slot, self._pending_mamba = self._pending_mamba, None
        if slot is None:
            return
        end = touched[-1][0] if touched else None
        if end is not None and end.mamba_value is None:
            end.mamba_value = slot.clone()
        else:
            self.mamba_pool.free(slot)

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """RadixCache.cache_finished_req; the request's state slot (``req.mamba_pool_idx``) goes to
        the tree when its tokens end on a page (the state after the cached key), else is freed; its
        pending checkpoints become node states."""
        slot = as_cpu_index(req.mamba_pool_idx, "req.mamba_pool_idx")
        key, kv, n = self._request_key_and_slots(req)
        if self.disable or not is_insert or n == 0 or n != len(req.fill_ids):
            self.mamba_pool.free(slot)
            super().cache_finished_req(req, is_insert)
        else:
            start = len(req.prefix_indices)
            params = InsertParams(key=key, value=kv[:n], mamba_value=slot, priority=request_priority(req))
            prefix_len = self.insert(params).prefix_len
            if prefix_len > start:
                self.token_to_kv_pool_allocator.free(kv[start:prefix_len])
            self._free_request_slots(kv[n:])
            self.dec_lock_ref(req.last_node)
        insert_request_checkpoints(self, req, key, is_insert, self.mamba_pool.free)

    # ---- eviction ----------------------------------------------------------------------------
    def _evict_device_node(self, node: TreeNode) -> int:
        if node.mamba_value is not None:
            self.mamba_pool.free(node.mamba_value, trusted=True)
            node.mamba_value = None
        return super()._evict_device_node(node)

    def _evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``num_tokens`` device KV slots and ``mamba_num`` states, unlocked leaves
        in policy order (a leaf's KV and state go together); less when not enough is evictable."""
        if self.disable or not (params.num_tokens or params.mamba_num):
            return EvictResult(0, 0)
        heap = [(self._priority(n), n) for n in self._all_nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        tokens = states = 0
        while (tokens < params.num_tokens or states < params.mamba_num) and heap:
            _, node = heapq.heappop(heap)
            states += node.mamba_value is not None
            tokens += self._evict_device_node(node)
            parent = node.parent
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent))
        logger.debug("evict: asked %d tokens / %d states, freed %d / %d", params.num_tokens, params.mamba_num,
                     tokens, states)
        return EvictResult(tokens, states)

    # ---- integrity ---------------------------------------------------------------------------
    def check_integrity(self, request_device_indices=(), check_hashes: bool = True, request_mamba_indices=()) -> None:
        """RadixCache.check_integrity plus the state pool: every state slot is free, a node's, or
        in ``request_mamba_indices`` (slots of running requests and their pending checkpoints)."""
        super().check_integrity(request_device_indices, check_hashes)
        if self.disable:
            return
        check_slot_partition("device mamba pool", self.mamba_pool.allocator,
                             {"tree": [n.mamba_value for n in self._all_nodes()],
                              "requests": list(request_mamba_indices)})
