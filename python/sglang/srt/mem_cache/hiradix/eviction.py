"""How nodes leave a tier of the HiRadixCache, and how TP ranks agree on slots.

``_reserve`` is the one place where slots for a backup or a load-back are taken: it agrees the
free-minus-needed margin per pool across TP ranks (one all-reduce MIN), evicts the same nodes
on every rank where the margin is negative, and allocates everywhere or nowhere.

Device eviction takes unlocked device leaves (nodes whose children are all host-only) in
policy order: a backed-up node keeps its host copy, others are written back first under
``write_back`` or dropped with their host-only descendants. It reads them from
``_device_candidates`` (node id -> node), a superset kept up to date where a node can become
one (the deepest node of an insert, a load-back's last node, a parent whose last device child
left) and pruned lazily; each node counts its children on device (``device_children``), so
neither the pick nor the leaf test reads a node's children.

Host eviction drops host-only leaves nobody pins (``protect_host``), deleting them from the
tree; it reads them from ``_host_leaves`` (node id -> node), a superset kept up to date
wherever a node can become one (its device copy released while childless, a new host leaf, a
deleted child: ``_add_host_leaf``) and pruned lazily, so it never walks the whole tree.
``_host_heap`` orders them across calls: each addition pushes (priority, node), and
a pop whose node is gone, no longer a leaf, pinned (kept aside, pushed back after) or whose
priority moved since (priorities only grow: access time and count) is skipped or re-pushed, so
an eviction costs O(evicted * log n) instead of rebuilding a heap of every host leaf per call.

A mixin of HiRadixCache: it uses the tree's ``cache_controller``, ``agreement``, ``KV``,
``write_policy``, ``_priority``, ``_all_nodes`` and the per-node slot hooks.
"""

from __future__ import annotations

import heapq
import logging

import torch

from sglang.srt.managers.cache_controller import Tier
from sglang.srt.mem_cache.radix.events import StorageMedium
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.controller.hicache_config import WritePolicy
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.controller.transfer_lane import HiCacheTransferError
from sglang.srt.mem_cache.radix.tree_node import TreeNode

logger = logging.getLogger(__name__)


class TierEvictionMixin:
    # ---- agreed reservation ------------------------------------------------------------------
    def _reserve(self, tier: Tier, need: dict[PoolName, int]) -> dict[PoolName, torch.Tensor] | None:
        """Allocate ``need`` slots per pool on ``tier`` on every TP rank or on none.

        One collective: the MIN over ranks of (free - need) per pool. Where it is negative every
        rank evicts the same nodes (same tree, same amount), so the outcome is the same
        everywhere. Returns the slots per pool, or None (nothing allocated) when short.

        Host slots that eviction takes from nodes go straight to the new owner (``_take``)
        instead of through the allocator's free list and back: in steady state every backup
        evicts about what it needs, and that round trip was a third of its cost (issue 9).
        """
        names = list(need) if len(need) == 1 else sorted(need, key=lambda n: n.value)  # one order on every rank
        local = []
        for n in names:
            local.append(self.cache_controller.available(tier, n) - need[n])
        margins = self.agreement.min(local)
        deficits = {}
        for n, m in zip(names, margins):  # loops, not comprehensions: this runs once a step
            if m < 0:
                deficits[n] = -m
        held: dict[PoolName, torch.Tensor] = {}
        if deficits:
            if tier is Tier.HOST:
                freed, held = self._evict_host_nodes(deficits, hold=True)
            else:
                freed = self._evict_device_nodes(deficits)
            for n, d in deficits.items():
                if freed.get(n, 0) < d:
                    self._free_slots(tier, held)
                    return None
        out: dict[PoolName, torch.Tensor] = {}
        for n in names:
            idx = self._take(tier, n, need[n], held.pop(n, None))
            if idx is None:
                self._free_slots(tier, {**out, **held})
                raise CacheIntegrityError(f"{tier.value} pool {n.value}: {need[n]} slots agreed free but not allocatable")
            out[n] = idx
        self._free_slots(tier, held)  # pools evicted along (hybrid side pools) that were not needed
        return out

    def _take(self, tier: Tier, name: PoolName, count: int, held: torch.Tensor | None) -> torch.Tensor | None:
        """``count`` slots of pool ``name``: ``held`` ones (evicted just now, still allocated)
        first, the allocator for the rest; the surplus of ``held`` is freed. None when the
        allocator is short (``held`` is then freed too)."""
        if held is None or held.numel() == 0:
            return self.cache_controller.alloc(tier, name, count)
        if held.numel() == count:
            return held
        if held.numel() > count:  # whole pages: counts are in the pool's page units
            self.cache_controller.free(tier, name, held[count:], trusted=True)
            return held[:count]
        rest = self.cache_controller.alloc(tier, name, count - held.numel())
        if rest is None:
            self.cache_controller.free(tier, name, held, trusted=True)
            return None
        return torch.cat([held, rest])

    # ---- device eviction ---------------------------------------------------------------------
    def _is_device_leaf(self, node: TreeNode) -> bool:
        # ``_value``: the stored slot list behind the stamped ``value`` property (a read needs no
        # stamp, and the property call costs as much as the rest of this test)
        return not (node is self.root_node or node._value is None or node.lock_ref or node.device_children)

    def _evict_tokens(self, num_tokens: int) -> int:
        """``evict``: free at least ``num_tokens`` device slots from unlocked device leaves (a
        node whose children are all host-only counts as a leaf). Backed-up nodes keep their host
        copy; others are backed up first under ``write_back``, else dropped. Returns tokens freed."""
        return self._evict_device_nodes({self.KV: num_tokens}).get(self.KV, 0) if num_tokens else 0

    def _device_leaves(self) -> list[TreeNode]:
        """Unlocked device leaves (``_is_device_leaf``), read from ``_device_candidates`` and
        pruned of the nodes that are no longer leaves (they come back when they are again).

        A walk of the device nodes visited every child of each, and a popular prefix may have
        thousands of host-only children: with the candidates an eviction reads no children."""
        cands = self._device_candidates
        out, gone = [], []
        for nid, node in cands.items():
            if node._value is None or node.device_children:
                gone.append(nid)
            elif not node.lock_ref:
                out.append(node)
        for nid in gone:
            del cands[nid]
        return out

    def _evict_device_nodes(self, deficits: dict[PoolName, int]) -> dict[PoolName, int]:
        freed = dict.fromkeys(deficits, 0)
        priority = self._priority
        if max(deficits.values(), default=0) <= 0:
            return freed
        heap = [(priority(n), n) for n in self._device_leaves()]
        if not heap:
            return freed
        heapq.heapify(heap)
        wanted = list(deficits.items())
        outer, self._device_free_batch = self._device_free_batch, []  # one allocator call per pool
        try:
            while heap:
                _, node = heapq.heappop(heap)
                for name, count in self._evict_device_node(node).items():
                    freed[name] = freed.get(name, 0) + count
                parent = node.parent
                if self._is_device_leaf(parent):
                    heapq.heappush(heap, (priority(parent), parent))
                for name, need in wanted:  # a plain loop: ``any`` over a generator costs two frames
                    if freed[name] < need:
                        break
                else:
                    break  # every deficit met
        finally:
            batch, self._device_free_batch = self._device_free_batch, outer
            self._free_batched(Tier.DEVICE, batch)
        if self._write_back_events:
            self._finish_write_back()
        return freed

    def _free_batched(self, tier: Tier, batch: list[dict[PoolName, torch.Tensor]]) -> None:
        self._free_slots(tier, batch[0] if len(batch) == 1 else self._merged(batch))

    @staticmethod
    def _merged(batch: list[dict[PoolName, torch.Tensor]]) -> dict[PoolName, torch.Tensor]:
        """Per pool, the slot lists of ``batch`` in order, as one tensor."""
        by_pool: dict[PoolName, list[torch.Tensor]] = {}
        for slots in batch:
            for name, idx in slots.items():
                if idx is not None:
                    by_pool.setdefault(name, []).append(idx)
        return {name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in by_pool.items()}

    def _evict_device_node(self, node: TreeNode) -> dict[PoolName, int]:
        if node._host_value is not None:  # backuped
            return self._release_device_copy(node, deferred=False)
        if self.write_policy is WritePolicy.WRITE_BACK and self._write_back(node):
            return self._release_device_copy(node, deferred=True)
        if node.host_ref_counter > 0:
            return {}  # host-only descendants are pinned by a storage operation
        return self._drop_subtree(node)

    def _release_device_copy(self, node: TreeNode, deferred: bool, stays: bool = True) -> dict[PoolName, int]:
        """Free (or queue the free of) ``node``'s device slots; returns the slot counts per
        pool. ``stays``: the node keeps its host copy in the tree (a host eviction candidate
        once childless); False when the caller deletes it next."""
        if self._kv_only:  # _device_slots and _clear_device, inline
            slots = {self.KV: node._value}
            node.value = None
        else:
            slots = self._device_slots(node)
            self._clear_device(node)
        self.evictable_size_ -= len(node._key.ids)
        if self.kv_events is not None:
            self.kv_events.removed(node)
        parent = node.parent
        parent.device_children -= 1
        if not parent.device_children and parent is not self.root_node:
            self._device_candidates[parent.id] = parent  # its last device child left: a device leaf
        if stays and not node.children:
            self._add_host_leaf(node)
        if deferred or self._device_free_batch is not None:
            (self._deferred_device_free if deferred else self._device_free_batch).append(slots)
            counts = {}
            for name, idx in slots.items():  # a loop, not a comprehension: no extra frame
                if idx is not None:
                    counts[name] = idx.numel()
            return counts
        return self._free_slots(Tier.DEVICE, slots)

    def _write_back(self, node: TreeNode) -> bool:
        host = self._reserve(Tier.HOST, self._backup_need([node]))
        if host is None:
            return False
        transfers = self._assign_host([node], host)
        self.protect_host(node)  # its host slots are being written: not evictable until done
        self._write_back_nodes.append(node)
        self._write_back_events.append(self.cache_controller.write(transfers, [node.id], ack=False))
        return True

    def _finish_write_back(self) -> None:
        """Wait for this eviction's write-backs, agree they all succeeded, then free the device
        slots they read. Raises HiCacheTransferError (on every rank) when one failed."""
        if not self._write_back_events:
            return
        ok = True
        for ev in self._write_back_events:
            try:
                ev.synchronize()
            except HiCacheTransferError:
                ok = False
        self._write_back_events = []
        nodes, self._write_back_nodes = self._write_back_nodes, []
        for node in nodes:
            self.release_host(node)
        if not self.agreement.all_true(ok):
            raise HiCacheTransferError("a write-back to host failed on at least one TP rank")
        for slots in self._deferred_device_free:
            self._free_slots(Tier.DEVICE, slots)
        self._deferred_device_free = []
        for node in nodes:
            self._on_write_done(node)  # host copy acknowledged on every rank: L3 backup

    def _drop_subtree(self, node: TreeNode) -> dict[PoolName, int]:
        """Delete a device leaf that has no host copy, with its host-only descendants."""
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            self._free_slots(Tier.HOST, self._host_slots(x))
            self._host_leaves.pop(x.id, None)  # leaves the tree with the subtree
            if self.kv_events is not None:
                self.kv_events.removed(x, StorageMedium.CPU)
        freed = self._release_device_copy(node, deferred=False, stays=False)  # not a host leaf: it goes now
        self._delete_leaf(node)
        return freed

    # ---- host eviction -----------------------------------------------------------------------
    def evict_host(self, num_tokens: int) -> int:
        """Drop host-only leaves nobody pins, policy order, until ``num_tokens`` host slots are
        free; the nodes leave the tree. Returns host tokens freed (less when not enough)."""
        if num_tokens < 0:
            raise ValueError(f"evict_host: num_tokens must be >= 0, got {num_tokens}")
        return self._evict_host_nodes({self.KV: num_tokens})[0].get(self.KV, 0) if num_tokens else 0

    def _add_host_leaf(self, node: TreeNode) -> None:
        """``node`` may have become a host-only leaf: a host eviction candidate from now on."""
        self._host_leaves[node.id] = node
        heapq.heappush(self._host_heap, (self._priority(node), node))
        if len(self._host_heap) > 2 * len(self._host_leaves) + 64:  # _compact_host_heap's test, inline
            self._compact_host_heap()  # bounded even when no host eviction ever pops the heap

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self._host_leaves.pop(node.id, None)
        self._device_candidates.pop(node.id, None)
        parent = node.parent
        if parent is not self.root_node and parent._value is None and not parent.children:
            self._add_host_leaf(parent)

    def _compact_host_heap(self) -> None:
        """Rebuild ``_host_heap`` from the candidates when stale entries (of nodes gone, loaded
        back or pushed again) dominate it: amortised O(1) per push, and nodes that left the tree
        are not kept alive by it for long."""
        heap, leaves = self._host_heap, self._host_leaves
        if len(heap) > 2 * len(leaves) + 64:
            self._host_heap = heap = [(self._priority(n), n) for n in leaves.values()]
            heapq.heapify(heap)

    def _evict_host_nodes(self, deficits: dict[PoolName, int], hold: bool = False
                          ) -> tuple[dict[PoolName, int], dict[PoolName, torch.Tensor]]:
        """Evict host-only leaves until ``deficits`` are met (or nothing is left to evict).
        Returns the slots freed per pool and, with ``hold``, the slots themselves, still
        allocated, for the caller to reuse or free (else they are freed here, and {})."""
        freed = dict.fromkeys(deficits, 0)
        self._compact_host_heap()
        heap, leaves, priority = self._host_heap, self._host_leaves, self._priority
        pinned: list[tuple] = []  # candidates still, once unpinned: pushed back at the end
        batch: list[dict[PoolName, torch.Tensor]] = []  # one allocator call per pool at the end
        held = False
        wanted = list(deficits.items())
        try:
            while heap:
                for name, need in wanted:  # still short in some pool? (a loop: no generator frames)
                    if freed[name] < need:
                        break
                else:
                    break
                key, node = heapq.heappop(heap)
                if leaves.get(node.id) is not node:
                    continue  # left the tree, or a duplicate entry of one evicted already
                if node._value is not None or node.children:
                    del leaves[node.id]  # loaded back or given a child: comes back when a leaf again
                    continue
                if node.host_ref_counter:
                    pinned.append((key, node))
                    continue
                now = priority(node)
                if now != key:  # accessed since it was pushed: its place is later
                    heapq.heappush(heap, (now, node))
                    continue
                if self._kv_only:  # _host_slots and _clear_host, inline
                    slots = {self.KV: node._host_value}
                    node.host_value = None
                else:
                    slots = self._host_slots(node)
                    self._clear_host(node)
                batch.append(slots)
                for name, idx in slots.items():
                    if idx is not None:
                        freed[name] = freed.get(name, 0) + idx.numel()
                if self.kv_events is not None:
                    self.kv_events.removed(node, StorageMedium.CPU)
                self._delete_leaf(node)  # pushes the parent when it becomes a host leaf
            held = hold
        finally:
            for entry in pinned:
                heapq.heappush(heap, entry)
            if not held:  # also when the walk raised: nothing is left owned by nobody
                self._free_batched(Tier.HOST, batch)
        return freed, (self._merged(batch) if held else {})

    def protect_host(self, node: TreeNode) -> None:
        """Pin the host copies of ``node`` and its ancestors against ``evict_host``."""
        self._check_attached(node, "protect_host")
        while node is not self.root_node:
            node.host_ref_counter += 1
            node = node.parent

    def release_host(self, node: TreeNode) -> None:
        """Undo one ``protect_host``; ValueError (nothing changed) when not pinned."""
        self._check_attached(node, "release_host")
        x = node
        while x is not self.root_node:
            if x.host_ref_counter <= 0:
                raise ValueError(f"release_host: node {x.id} is not pinned")
            x = x.parent
        while node is not self.root_node:
            node.host_ref_counter -= 1
            node = node.parent
