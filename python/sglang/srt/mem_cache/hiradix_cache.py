"""HiRadixCache: the radix tree over two tiers, device (L1) and host (L2).

Each node has a device value and/or a host value (both per-token slot lists) and its page
hashes. Device copies are downward closed: a node without one has no descendant with one, so
a match is a device prefix followed by a host-only part (``host_hit_length``).

Life of a prefix: ``insert`` adds it on device and, by the write policy, queues a host backup
(the node stays locked until the write is acknowledged); ``evict`` frees device copies of
unlocked leaves (backed-up nodes keep their host copy, others are dropped; ``write_back``
backs them up first); ``evict_host`` drops host-only leaves; ``init_load_back`` gives a
host-only chain fresh device slots and queues the copy; ``ready_to_load_host_cache`` starts
it layer by layer; ``check_hicache_events`` consumes finished writes and loads.

TP ranks keep identical trees: every locally observed quantity (free slots for a backup or a
load-back, transfers finished) is agreed by an all-reduce MIN before the tree acts on it, and
each of those calls happens on every rank (see ``tp_agreement.py``).

Storage (L3), when the controller has a backend: ``prefetch_from_storage`` /
``check_prefetch_progress`` / ``release_aborted_request`` bring pages from storage into
host-only nodes, and every acknowledged host copy is backed up to storage
(``hiradix_storage.py``). Their counts ride on the one per-step agreement vector
(``_storage_progress`` / ``_on_storage_progress``).

KV events (``enable_kv_cache_events``): a device copy is published with medium ``GPU`` when it
appears (insert, an evicted node re-adopting recomputed KV, load-back) and a host copy with
``CPU_PINNED`` once its write is acknowledged (the fragments a split made of it included) or its
pages arrive from storage; a copy leaving a tier is a ``BlockRemoved`` of that tier.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.managers.cache_controller import HiCacheController, L2Transfer, Tier
from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError, check_slot_partition
from sglang.srt.mem_cache.controller.hicache_config import DEFAULT_PREFETCH_POLICY
from sglang.srt.mem_cache.hiradix.eviction import TierEvictionMixin
from sglang.srt.mem_cache.hiradix.storage_side import StorageTreeMixin
from sglang.srt.mem_cache.radix.page_hash import page_hashes
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.controller.transfer_lane import HiCacheTransferError
from sglang.srt.mem_cache.radix.events import StorageMedium
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode, empty_indices

logger = logging.getLogger(__name__)


class HiRadixCache(TierEvictionMixin, StorageTreeMixin, RadixCache):
    """``prefetch_stop_policy``: when a waiting request stops waiting for its L3 prefetch
    (``best_effort``, ``wait_complete``, ``timeout``); ``prefetch_retry``: when a missed L3
    check is issued again (``PrefetchRetrySettings``, default upstream's); unused without storage."""

    # The state this class and its mixins add lives in slots, not in the instance dict: CPython
    # (3.11+) keeps an instance's attributes in a shared-key layout only up to 30 names, and past
    # that every attribute read and method call on the tree leaves the specialized fast path
    # (~30% slower, on every per-step path of the tree; issue 9). RadixCache's own attributes
    # (and a subclass's) stay in the dict, well under the limit.
    __slots__ = (
        "cache_controller", "write_policy", "_backup_threshold", "agreement", "load_back_threshold", "KV",
        "_kv_only", "ongoing_write_through", "ongoing_load_back", "defer_backups", "_due_backups",
        "_write_back_events", "_write_back_nodes", "_deferred_device_free", "_device_free_batch",
        "_quarantined_on_reset", "_host_leaves", "_host_heap", "_device_candidates",
        # StorageTreeMixin (hiradix_storage.py)
        "prefetch_stop_policy", "storage", "ongoing_prefetch", "prefetch_loaded_tokens", "_write_tokens",
        "storage_prefetch_retries",
    )

    def __init__(self, params: CacheInitParams, cache_controller: HiCacheController, load_back_threshold: int = 0,
                 prefetch_stop_policy=DEFAULT_PREFETCH_POLICY, prefetch_retry=None):
        if params.disable:
            raise ValueError("HiRadixCache cannot be disabled; use RadixCache(disable=True)")
        params.check_same_cache(cache_controller.params)
        if load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0, got {load_back_threshold}")
        self.cache_controller = cache_controller
        self.write_policy = cache_controller.write_policy
        self._backup_threshold = self.write_policy.backup_threshold  # read on every insert
        self.agreement = cache_controller.agreement
        self.load_back_threshold = load_back_threshold
        self.KV = cache_controller.anchor_name
        # No per-node slot hook overridden (no side pools): the eviction loops then read and
        # clear a node's one slot list themselves, without the four hook calls per node.
        self._kv_only = all(getattr(type(self), h) is getattr(HiRadixCache, h)
                            for h in ("_device_slots", "_host_slots", "_clear_device", "_clear_host"))
        self.ongoing_write_through: dict[int, TreeNode] = {}
        self.ongoing_load_back: dict[int, TreeNode] = {}
        # With defer_backups (set by the scheduler), write-through backups that insert makes due
        # wait, locked, in _due_backups until flush_backups: one reservation and write per step.
        self.defer_backups = False
        self._due_backups: dict[int, TreeNode] = {}
        self._write_back_events: list = []
        self._write_back_nodes: list[TreeNode] = []
        self._deferred_device_free: list[dict[PoolName, torch.Tensor]] = []
        self._device_free_batch: list[dict[PoolName, torch.Tensor]] | None = None  # during an eviction
        self._quarantined_on_reset: dict[PoolName, torch.Tensor] = {}  # host slots reset must not free
        self._init_storage(prefetch_stop_policy, prefetch_retry)
        super().__init__(params)

    def _new_root(self) -> None:
        super()._new_root()
        self.root_node.host_value = empty_indices()
        self._host_leaves: dict[int, TreeNode] = {}  # candidates of host eviction (hiradix_eviction.py)
        self._host_heap: list[tuple] = []  # (priority when pushed, node) over them, stale entries skipped
        self._device_candidates: dict[int, TreeNode] = {}  # a superset of the device leaves (hiradix_eviction.py)

    # ---- per-node slots (extended by hybrid trees) -------------------------------------------
    def _device_slots(self, node: TreeNode) -> dict[PoolName, torch.Tensor]:
        return {self.KV: node.value}

    def _host_slots(self, node: TreeNode) -> dict[PoolName, torch.Tensor]:
        return {self.KV: node.host_value}

    def _clear_device(self, node: TreeNode) -> None:
        node.value = None

    def _clear_host(self, node: TreeNode) -> None:
        node.host_value = None

    def _free_slots(self, tier: Tier, slots: dict[PoolName, torch.Tensor]) -> dict[PoolName, int]:
        freed = {}
        for name, idx in slots.items():
            if idx is not None:
                self.cache_controller.free(tier, name, idx, trusted=True)  # a node's own slots
                freed[name] = idx.numel()
        return freed

    def _free_node_slots(self, node: TreeNode) -> None:
        if node.value is not None:
            self._free_slots(Tier.DEVICE, self._device_slots(node))
        if node.host_value is not None:
            slots = self._host_slots(node)
            for name, keep in self._quarantined_on_reset.items():
                if slots.get(name) is not None:
                    slots[name] = slots[name][~torch.isin(slots[name], keep)]
            self._free_slots(Tier.HOST, slots)

    # ---- match -------------------------------------------------------------------------------
    def _match_result(self, path: list[TreeNode]) -> MatchResult:
        values = []
        for n in path:
            v = n._value
            if v is None:
                break
            values.append(v)
        k = len(values)
        host_len = 0
        for n in path[k:]:
            if n._host_value is None:
                raise CacheIntegrityError("a node with neither a device nor a host copy is in the tree")
            host_len += len(n._key.ids)
        device = torch.cat(values) if k else empty_indices()
        last_device = path[k - 1] if k else self.root_node
        last_host = path[-1] if path else self.root_node
        return MatchResult(device, last_device, last_host, host_len)

    # ---- insert and backup -------------------------------------------------------------------
    def _insert_existing(self, node: TreeNode, value: torch.Tensor) -> bool:
        node.value = value.clone()  # evicted (insert asks only then): the recomputed KV comes back
        node.parent.device_children += 1
        self.evictable_size_ += value.numel()
        if self.kv_events is not None:
            self.kv_events.stored(node)
        return True

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        new = super()._split_node(child, split_len)
        new.device_children = 1 if child._value is not None else 0  # its one child; the parent's count is unchanged
        return new

    def _on_inserted(self, touched: list[tuple[TreeNode, bool]], chunked: bool) -> None:
        if touched:  # the path's deepest node is on device, any child of it host-only: a device leaf
            end, new = touched[-1]
            if new:
                end.parent.device_children += 1
            self._device_candidates[end.id] = end
        threshold = self._backup_threshold
        if threshold is None or chunked:
            return
        due = []
        for node, _ in touched:
            node.hit_count += 1
            if node._host_value is None and node.hit_count >= threshold and node.id not in self._due_backups:
                due.append(node)
        if not due:
            return
        if not self.defer_backups:
            self._write_backup_nodes(due)
            return
        for node in due:  # locked now, as a queued write would be; backed up at flush_backups
            self._lock_path(node)  # on the insert's path: attached, on device
            self._due_backups[node.id] = node

    def flush_backups(self) -> int:
        """Back up the nodes ``insert`` made due since the last call (``defer_backups``): one
        host reservation and one write for all of them (the scheduler calls it once a step).
        Mutates: the lock each took becomes its write's lock, or is released (no longer due,
        or the host pool short on some rank). Returns the tokens queued."""
        if not self._due_backups:
            return 0
        nodes, self._due_backups = list(self._due_backups.values()), {}
        due, ids = [], set()
        for node in nodes:
            if node._value is not None and node._host_value is None:  # on device, not backed up
                due.append(node)
                ids.add(node.id)
            else:
                self._unlock_path(node)  # the lock _on_inserted took
        queued = 0
        try:
            queued = self._write_backup_nodes(due, locked=ids) if due else 0
        finally:
            if not queued:
                for node in due:
                    self._unlock_path(node)
        return queued

    def flush_step(self) -> None:
        """The scheduler's flush at the end of each step (and after an abort between steps):
        the due backups (``flush_backups``), then every deferred write as one lane job
        (``start_writing``). Two tests when there is nothing to do."""
        if self._due_backups:
            self.flush_backups()
        if self.cache_controller.write_queue:
            self.cache_controller.start_writing()

    def _drop_due_backups(self) -> None:
        nodes, self._due_backups = list(self._due_backups.values()), {}
        for node in nodes:
            self._unlock_path(node)

    def write_backup(self, node: TreeNode) -> int:
        """Back ``node`` up to host now (asynchronously; locked until acknowledged).
        Returns the tokens queued, 0 when host slots could not be found on every rank."""
        self._check_attached(node, "write_backup")
        if node.evicted or node.backuped:
            return 0
        return self._write_backup_nodes([node])

    def _backup_need(self, nodes: list[TreeNode]) -> dict[PoolName, int]:
        tokens = 0
        for n in nodes:  # len(key.ids): numpy's length, no RadixKey.__len__ frame (per step)
            tokens += len(n._key.ids)
        return {self.KV: tokens}

    def _assign_host(self, nodes: list[TreeNode], host: dict[PoolName, torch.Tensor]) -> list[L2Transfer]:
        """Give ``nodes`` their host slots (in order); the transfers that fill them."""
        slots, off = host[self.KV], 0
        for n in nodes:  # views of the fresh allocation: nothing writes slot lists in place
            k = len(n._key.ids)
            n.host_value = slots[off : off + k]
            off += k
        if len(nodes) == 1:
            return [L2Transfer(self.KV, slots, nodes[0]._value)]
        values = []
        for n in nodes:  # a loop, not a comprehension: no extra frame (once a step)
            values.append(n._value)
        return [L2Transfer(self.KV, slots, torch.cat(values))]

    def _write_backup_nodes(self, nodes: list[TreeNode], locked: set[int] | frozenset = frozenset()) -> int:
        """Reserve host slots for ``nodes`` and queue their write; each is locked until it is
        acknowledged (those in ``locked`` already hold the lock the write keeps). Returns the
        tokens queued, 0 (nothing locked or queued) when the host pool is short on some rank."""
        host = self._reserve(Tier.HOST, self._backup_need(nodes))
        if host is None:
            logger.debug("backup of %d nodes refused: host pool full on some rank", len(nodes))
            return 0
        transfers = self._assign_host(nodes, host)
        tokens = 0
        for n in nodes:  # attached device nodes (callers check; ancestors of one are on device)
            if n.id not in locked:
                self._lock_path(n)
            self.ongoing_write_through[n.id] = n
            self._write_tokens[n.id] = k = len(n._key.ids)
            tokens += k
        self.cache_controller.write(transfers, [n.id for n in nodes])
        return tokens

    def insert_host(self, key: RadixKey, host_indices: torch.Tensor) -> int:
        """Cache ``key`` (whole pages) as host-only nodes holding ``host_indices`` (host slots,
        one per token), e.g. pages prefetched from storage.

        Returns the number of leading tokens the tree already held on either tier: the caller
        still owns ``host_indices[:returned]`` and frees them; the rest belongs to the tree.
        """
        key, host = self._checked_host_insert(key, host_indices)
        return self._insert_host_from(self.root_node, key, host)

    def _checked_host_insert(self, key: RadixKey, host_indices) -> tuple[RadixKey, torch.Tensor]:
        return self._check_paged_slots(key, host_indices, "insert_host", "insert_host host_indices", "host slots")

    def _insert_host_from(self, node: TreeNode, key: RadixKey, host: torch.Tensor) -> int:
        """insert_host for ``key`` continuing after ``node`` (an attached node)."""
        pos, now = 0, self._tick()
        while pos < len(key):
            child = self._step(node, key, pos)
            if child is None:
                break
            child.last_access_time = now
            pos, node = pos + len(child.key), child
        if pos < len(key):
            self._new_host_leaf(node, key[pos:], host[pos:], now)
        return pos

    def _new_host_leaf(self, parent: TreeNode, key: RadixKey, host: torch.Tensor, now: int) -> TreeNode:
        """A host-only child of ``parent`` holding ``host`` (host slots of ``key``)."""
        leaf = TreeNode(parent=parent, key=key.copy())
        leaf.host_value = host.clone()
        leaf.hash_value = page_hashes(leaf.key.ids, self.page_size, leaf.prior_hash())
        leaf.last_access_time = now
        self._attach(parent, leaf)
        self._add_host_leaf(leaf)
        if self.kv_events is not None:
            self.kv_events.stored(leaf, StorageMedium.CPU)
        return leaf

    # ---- load back ---------------------------------------------------------------------------
    def init_load_back(self, last_node: TreeNode, host_hit_length: int, mem_quota: int | None = None):
        """Give the host-only chain ending at ``last_node`` fresh device slots and queue its load.

        Returns the new device slots (int64, the chain's tokens root first: append them to the
        match's ``device_indices``), an empty tensor when nothing is host-only, or None when
        refused: ``host_hit_length`` below ``load_back_threshold``, more tokens than
        ``mem_quota``, or device slots short on some TP rank. The chain is locked until its load
        is acknowledged; lock ``last_node`` for the request as usual. Bytes are valid once
        ``ready_to_load_host_cache`` has started the load and the layer events have fired.
        """
        self._check_attached(last_node, "init_load_back")
        chain, ancestor = [], last_node
        while ancestor.evicted:
            chain.append(ancestor)
            ancestor = ancestor.parent
        chain.reverse()
        if not chain:
            return empty_indices()
        total = sum(len(n.key) for n in chain)
        if host_hit_length < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            return None
        self.protect_host(last_node)
        self.inc_lock_ref(ancestor)
        try:
            device = self._reserve(Tier.DEVICE, self._load_need(chain))
        finally:
            self.dec_lock_ref(ancestor)
            self.release_host(last_node)
        if device is None:
            return None
        transfers = self._assign_device(chain, device)
        self.inc_lock_ref(last_node)
        self.ongoing_load_back[last_node.id] = last_node
        self.cache_controller.load(transfers, [last_node.id])
        return device[self.KV]

    def _load_need(self, chain: list[TreeNode]) -> dict[PoolName, int]:
        return {self.KV: sum(len(n.key) for n in chain)}

    def _assign_device(self, chain: list[TreeNode], device: dict[PoolName, torch.Tensor]) -> list[L2Transfer]:
        off = 0
        for n in chain:
            n.value = device[self.KV][off : off + len(n.key)].clone()
            n.parent.device_children += 1
            off += len(n.key)
            self.evictable_size_ += len(n.key)
            if self.kv_events is not None:
                self.kv_events.stored(n)
        self._device_candidates[chain[-1].id] = chain[-1]  # its children are host-only
        return [L2Transfer(self.KV, torch.cat([n.host_value for n in chain]), device[self.KV])]

    def ready_to_load_host_cache(self) -> int:
        """Start the queued load-backs; return the LayerDoneCounter index the next forward
        sets as consumer (-1: no load in flight). Even with nothing queued it names a load
        still running, so slots of a load-back whose request was not scheduled are never read
        before they arrive."""
        return self.cache_controller.start_loading()

    # ---- events ------------------------------------------------------------------------------
    def check_hicache_events(self) -> None:
        """Consume finished writes and loads: one agreed vector per call, on every rank.

        Mutates: unlocks acknowledged nodes. Raises HiCacheTransferError on every rank when a
        transfer failed on any rank.
        """
        controller = self.cache_controller
        if self.storage is None and not controller.ack_write_queue and not controller.ack_load_queue:
            # Nothing to consume. Every rank queued the same acks and popped the agreed counts,
            # so the queues are empty on all of them at once: all skip the collective together.
            return
        local = controller.local_progress()
        if self.storage is not None:
            local += self._storage_progress()
        agreed = self.agreement.min(local)
        writes, loads, ok = agreed[:3]
        if not ok:
            raise HiCacheTransferError("a host transfer failed on at least one TP rank")
        for ack in controller.pop_write_acks(writes):
            for nid in ack.node_ids:
                node = self.ongoing_write_through.pop(nid)
                self._unlock_path(node)  # the lock _write_backup_nodes took
                self._on_write_done(node)
        if loads:
            for ack in controller.pop_load_acks(loads):
                for nid in ack.node_ids:
                    self._unlock_path(self.ongoing_load_back.pop(nid))  # init_load_back's lock
        if self.storage is not None:
            self._on_storage_progress(agreed[3:])

    # ---- reset and integrity -----------------------------------------------------------------
    def reset(self, timeout_s: float | None = None) -> None:
        """Wait for every transfer, consume the acks, drop every node and free its slots on
        both tiers; prefetches end with nothing kept. ValueError (nothing dropped) while a
        request still holds a lock.

        With storage the wait for L3 operations is bounded by ``timeout_s`` (default: the
        ``flush_timeout_s`` extra config key): operations still running then are abandoned,
        their host slots held (quarantined) until their thread returns, and, after the reset,
        ``HiCacheFlushIncomplete`` is raised on every rank. The tree is empty and usable then.
        """
        error = None
        self._drop_due_backups()
        if self.storage is not None:
            self._quarantined_on_reset, error = self._drain_storage(timeout_s)
        else:
            self.cache_controller.synchronize()
            self.check_hicache_events()
        try:
            super().reset()
        finally:
            self._quarantined_on_reset = {}
        self.cache_controller.reset()
        self._write_tokens.clear()
        self.prefetch_loaded_tokens.clear()
        if error is not None:
            raise error

    def _check_node(self, node: TreeNode) -> None:
        self._check_device_children(node)
        if node.evicted and not node.backuped:
            raise CacheIntegrityError(f"node {node.id} has neither a device nor a host copy")
        if node.evicted and (node.lock_ref or any(not c.evicted for c in node.children.values())):
            raise CacheIntegrityError(f"node {node.id} is evicted but locked or above a device node")
        if node.evicted and not node.children and self._host_leaves.get(node.id) is not node:
            raise CacheIntegrityError(f"node {node.id} is a host-only leaf missing from the host eviction candidates")

    def _check_device_children(self, node: TreeNode) -> None:
        on_device = sum(1 for c in node.children.values() if not c.evicted)
        if node.device_children != on_device:
            raise CacheIntegrityError(
                f"node {node.id} counts {node.device_children} children on device, has {on_device}")
        if not node.evicted and not on_device and node is not self.root_node \
                and self._device_candidates.get(node.id) is not node:
            raise CacheIntegrityError(f"node {node.id} is a device leaf missing from the device eviction candidates")

    def _check_eviction_candidates(self) -> None:
        for nid, node in self._host_leaves.items():
            if not self._is_attached(node):
                raise CacheIntegrityError(f"node {nid} left the tree but is still a host eviction candidate")
        for nid, node in self._device_candidates.items():
            if not node.evicted and not self._is_attached(node):
                raise CacheIntegrityError(
                    f"node {nid} left the tree with its device copy but is still a device eviction candidate")

    def check_integrity(self, request_device_indices=(), check_hashes: bool = True, request_host_indices=()) -> None:
        """RadixCache.check_integrity plus the host tier: every host slot is free, in the tree,
        held by a storage operation (an in-flight prefetch, a backup a bounded flush
        abandoned), or in ``request_host_indices``."""
        super().check_integrity(request_device_indices, check_hashes)
        self._check_device_children(self.root_node)
        self._check_eviction_candidates()
        for nid, node in {**self.ongoing_write_through, **self.ongoing_load_back}.items():
            if not self._is_attached(node) or node.evicted or node.lock_ref == 0:
                raise CacheIntegrityError(f"node {nid} has a transfer in flight but is gone, evicted or unlocked")
        self._check_storage_ops()
        owners = {
            "tree": [n.host_value for n in self._all_nodes()],
            "storage": self.cache_controller.held_host_indices(self.KV),
            "requests": list(request_host_indices),
        }
        check_slot_partition("host pool", self.cache_controller.bindings[self.KV].host_alloc, owners)
