"""HiMambaRadixCache: the two-tier tree for hybrid models (attention KV + Mamba state).

A prefix is reusable only where the Mamba state after it is known, so a node may carry one
state: ``mamba_value`` (a device Mamba slot) and ``mamba_host_value`` (a host slot). A state
lives in the tier its node's KV lives in: a device state only on a node with device KV. A match
ends at the deepest matched node with a state in its KV's tier ("match point"); the state is
then ``last_device_node.mamba_value`` (after any load-back), which the scheduler copies into
the request's own slot.

Host copies form a contiguous prefix from the root: a node is backed up only together with
its not-yet-backed-up ancestors, and only host-only leaves leave the host, so every host state
has host or device KV all the way up. Eviction, load-back and backup move a node's KV and state
together through the ``mamba`` pool binding of a HybridCacheController.

Storage (L3): states travel with their KV pages, keyed by the node's last page hash; pages from
storage enter the tree only with the state that ends them (``hi_mamba_storage.py``).
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.managers.cache_controller import L2Transfer, Tier
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchResult,
    request_priority,
)
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError, check_slot_partition
from sglang.srt.mem_cache.radix.mamba_checkpoints import insert_request_checkpoints
from sglang.srt.mem_cache.hiradix.mamba_storage import MambaStorageMixin
from sglang.srt.mem_cache.controller.hicache_config import DEFAULT_PREFETCH_POLICY
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix.tree_node import TreeNode, empty_indices
from sglang.srt.mem_cache.utils import as_cpu_index

logger = logging.getLogger(__name__)

MAMBA = PoolName.MAMBA


class HiMambaRadixCache(MambaStorageMixin, HiRadixCache):
    def __init__(self, params, cache_controller, load_back_threshold: int = 0,
                 prefetch_stop_policy=DEFAULT_PREFETCH_POLICY, prefetch_retry=None):
        if MAMBA not in cache_controller.bindings:
            raise ValueError("HiMambaRadixCache needs a controller with a 'mamba' pool (HybridCacheController)")
        self._pending_mamba: torch.Tensor | None = None
        super().__init__(params, cache_controller, load_back_threshold, prefetch_stop_policy, prefetch_retry)

    def supports_mamba(self) -> bool:
        return True

    # ---- slots -------------------------------------------------------------------------------
    def _device_slots(self, node):
        return {self.KV: node.value, MAMBA: node.mamba_value}

    def _host_slots(self, node):
        return {self.KV: node.host_value, MAMBA: node.mamba_host_value}

    def _clear_device(self, node) -> None:
        node.value = node.mamba_value = None

    def _clear_host(self, node) -> None:
        node.host_value = node.mamba_host_value = None

    def _is_match_point(self, node: TreeNode) -> bool:
        return node.mamba_value is not None if not node.evicted else node.mamba_host_value is not None

    # ---- match and insert --------------------------------------------------------------------
    def _match_result(self, path: list[TreeNode]) -> MatchResult:
        """The device part ends at the deepest node with a device state; everything after it up
        to the deepest match point (device KV without a state, then host-only) is the host hit."""
        end = len(path)
        while end and not self._is_match_point(path[end - 1]):
            end -= 1
        path = path[:end]
        j = 0
        while j < len(path) and not path[j].evicted:
            j += 1
        while j and not self._is_match_point(path[j - 1]):
            j -= 1
        device = torch.cat([n.value for n in path[:j]]) if j else empty_indices()
        last_device = path[j - 1] if j else self.root_node
        last_host = path[-1] if path else self.root_node
        return MatchResult(device, last_device, last_host, sum(len(n.key) for n in path[j:]))

    def init_load_back(self, last_node: TreeNode, host_hit_length: int, mem_quota: int | None = None):
        """HiRadixCache.init_load_back; the returned slots also cover the device nodes without
        a state between the match's ``last_device_node`` and the loaded chain, so they still
        append to the match's ``device_indices``."""
        self._check_attached(last_node, "init_load_back")
        bridge, x = [], last_node
        while x.evicted:
            x = x.parent
        while x is not self.root_node and not self._is_match_point(x):
            bridge.append(x.value)
            x = x.parent
        loaded = super().init_load_back(last_node, host_hit_length, mem_quota)
        if loaded is None:
            return None
        return torch.cat([*reversed(bridge), loaded])

    def insert(self, params: InsertParams) -> InsertResult:
        """HiRadixCache.insert, plus ``params.mamba_value``: a device Mamba slot (1 element)
        holding the state after the key's whole pages. Its ownership passes to the tree: kept by
        the node ending at the key when that node has no device state yet, freed otherwise."""
        mamba_value = params.mamba_value
        if mamba_value is not None:
            mamba_value = as_cpu_index(mamba_value, "mamba_value")
            if mamba_value.numel() != 1:
                raise ValueError(f"mamba_value must be one slot, got {mamba_value.numel()}")
            if params.key is not None and len(params.key) % self.page_size:
                # the state follows the whole key; a node can only end on a page boundary
                raise ValueError(f"insert with a mamba_value needs whole pages: the key has {len(params.key)} "
                                 f"tokens, page_size {self.page_size}")
        self._pending_mamba = mamba_value
        try:
            return super().insert(params)
        finally:
            if self._pending_mamba is not None:  # insert failed before adopting it
                self._pending_mamba = None

    def _on_inserted(self, touched, chunked) -> None:
        slot, self._pending_mamba = self._pending_mamba, None
        if slot is not None:
            end = touched[-1][0] if touched else None
            if end is not None and end.mamba_value is None:
                end.mamba_value = slot.clone()
            else:
                self.cache_controller.free(Tier.DEVICE, MAMBA, slot)
        super()._on_inserted(touched, chunked)

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """HiRadixCache.cache_finished_req; ``req.mamba_pool_idx`` (the request's state slot)
        goes to the tree when ``fill_ids`` is page-aligned (its state is then the state after the
        cached key), and is freed otherwise. The request's pending checkpoints
        (``req.mamba_checkpoints``, ``managers/mamba_state.py``) become the states of the nodes
        ending at their positions (freed when not inserting)."""
        slot = as_cpu_index(req.mamba_pool_idx, "req.mamba_pool_idx")
        aligned = len(req.fill_ids) % self.page_size == 0 and len(req.fill_ids) > 0
        key, kv, n = self._request_key_and_slots(req)
        if not (is_insert and aligned):
            self.cache_controller.free(Tier.DEVICE, MAMBA, slot)
            super().cache_finished_req(req, is_insert)
        else:
            start = len(req.prefix_indices)
            params = InsertParams(key=key, value=kv[:n], mamba_value=slot, priority=request_priority(req))
            prefix_len = self.insert(params).prefix_len
            if prefix_len > start:
                self.token_to_kv_pool_allocator.free(kv[start:prefix_len])
            self._free_request_slots(kv[n:])
            self.dec_lock_ref(req.last_node)
        self._insert_checkpoints(req, key, is_insert)

    def _insert_checkpoints(self, req, key, is_insert: bool) -> None:
        insert_request_checkpoints(self, req, key, is_insert,
                                   lambda slot: self.cache_controller.free(Tier.DEVICE, MAMBA, slot))

    # ---- backup: whole unbacked ancestor chains ----------------------------------------------
    def _with_unbacked_ancestors(self, nodes: list[TreeNode]) -> list[TreeNode]:
        out, seen = [], set()
        for node in nodes:
            chain, x = [], node
            while x is not self.root_node and not x.backuped and x.id not in seen:
                chain.append(x)
                seen.add(x.id)
                x = x.parent
            out.extend(reversed(chain))
        return out

    def _write_backup_nodes(self, nodes: list[TreeNode], locked=frozenset()) -> int:
        return super()._write_backup_nodes(self._with_unbacked_ancestors(nodes), locked)

    def _write_back(self, node: TreeNode) -> bool:
        ancestors = self._with_unbacked_ancestors([node])[:-1]
        if ancestors and not self._write_backup_nodes(ancestors):
            return False
        return super()._write_back(node)

    def _backup_need(self, nodes):
        return {self.KV: sum(len(n.key) for n in nodes), MAMBA: sum(n.mamba_value is not None for n in nodes)}

    def _assign_host(self, nodes, host):
        transfers = super()._assign_host(nodes, host)
        stateful = [n for n in nodes if n.mamba_value is not None]
        for i, n in enumerate(stateful):
            n.mamba_host_value = host[MAMBA][i : i + 1].clone()
        if stateful:
            transfers.append(L2Transfer(MAMBA, host[MAMBA], torch.cat([n.mamba_value for n in stateful])))
        return transfers

    # ---- load back ---------------------------------------------------------------------------
    def _load_need(self, chain):
        return {self.KV: sum(len(n.key) for n in chain), MAMBA: sum(n.mamba_host_value is not None for n in chain)}

    def _assign_device(self, chain, device):
        transfers = super()._assign_device(chain, device)
        stateful = [n for n in chain if n.mamba_host_value is not None]
        for i, n in enumerate(stateful):
            n.mamba_value = device[MAMBA][i : i + 1].clone()
        if stateful:
            transfers.append(L2Transfer(MAMBA, torch.cat([n.mamba_host_value for n in stateful]), device[MAMBA]))
        return transfers

    def _evict(self, params: EvictParams) -> EvictResult:
        """``evict``: free at least ``num_tokens`` device KV slots and ``mamba_num`` device Mamba
        states, in one pass over unlocked device leaves (a leaf's KV and state go together)."""
        deficits = {self.KV: params.num_tokens, MAMBA: params.mamba_num}
        freed = self._evict_device_nodes(deficits) if params.num_tokens or params.mamba_num else {}
        return EvictResult(freed.get(self.KV, 0), freed.get(MAMBA, 0))

    # ---- integrity ---------------------------------------------------------------------------
    def _check_node(self, node: TreeNode) -> None:
        super()._check_node(node)
        if node.backuped and not (node.parent is self.root_node or node.parent.backuped):
            raise CacheIntegrityError(f"node {node.id} is backed up but its parent is not")
        if (node.mamba_value is not None and node.evicted) or (node.mamba_host_value is not None and not node.backuped):
            raise CacheIntegrityError(f"node {node.id} holds a Mamba state in a tier without its KV")

    def check_integrity(self, request_device_indices=(), check_hashes: bool = True, request_host_indices=(),
                        request_mamba_indices=()) -> None:
        """HiRadixCache.check_integrity plus both Mamba pools: every state slot is free, a
        node's, held by a storage operation (host), or in ``request_mamba_indices`` (device
        slots of running requests)."""
        super().check_integrity(request_device_indices, check_hashes, request_host_indices)
        nodes = list(self._all_nodes())
        binding = self.cache_controller.bindings[MAMBA]
        check_slot_partition("device mamba pool", binding.device_alloc,
                             {"tree": [n.mamba_value for n in nodes], "requests": list(request_mamba_indices)})
        check_slot_partition("host mamba pool", binding.host_alloc,
                             {"tree": [n.mamba_host_value for n in nodes],
                              "storage": self.cache_controller.held_host_indices(MAMBA)})
