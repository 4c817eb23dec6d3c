"""RadixCache: a paged radix tree over the device (L1) token slots.

Keys advance a whole page (``page_size`` tokens) per step; children are keyed by their
namespace (``extra_key``) and the bytes of their first page, and a node's key is one int64
array compared in bulk (``radix_key.py``), so no operation loops over tokens in Python. Every
node carries its page-hash chain (``page_hash.py``), seeded by ``namespace_hash(extra_key)``;
a split slices the hash list and never rehashes. The tree passes slot indices around and never touches KV bytes.

Calls take upstream's records (``base_prefix_cache``): ``match_prefix(MatchPrefixParams(key=))``,
``insert(InsertParams(key=, value=))`` -> ``InsertResult``, ``evict(EvictParams(num_tokens=))`` ->
``EvictResult``.

Ownership: slots handed to ``insert`` become the tree's, except the leading ``prefix_len``
tokens it already held (the caller frees those duplicates) and a trailing partial page (never
inserted). ``evict`` returns slots of unlocked leaves to the allocator. ``inc_lock_ref`` /
``dec_lock_ref`` protect a node and its ancestors.

KV events (``enable_kv_cache_events``): ``BlockStored`` for each page a new leaf brings,
``BlockRemoved`` for an evicted leaf's pages, ``AllBlocksCleared`` on reset; ``take_events``
drains them. With events off ``kv_events`` is None and recording costs one attribute test.

Request bookkeeping (``cache_finished_req`` / ``cache_unfinished_req``) is in
``radix/requests.py``.
"""

from __future__ import annotations

import heapq
import logging
from typing import Iterable, Iterator

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionPolicy, eviction_priority
from sglang.srt.mem_cache.radix.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError, check_slot_partition, check_tree_nodes
from sglang.srt.mem_cache.radix.page_hash import page_hashes
from sglang.srt.mem_cache.radix.radix_key import common_prefix_len
from sglang.srt.mem_cache.radix.requests import RequestCacheMixin
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode, empty_indices, new_stamp
from sglang.srt.mem_cache.utils import as_cpu_index, check_page_aligned

__all__ = ["RadixCache", "RadixKey", "TreeNode"]

logger = logging.getLogger(__name__)


class _DiscardSlots:
    """Where a simulated tree without an allocator frees slots to: nowhere."""

    device = torch.device("cpu")

    def free(self, slots, trusted: bool = False) -> None:
        pass

    def available_size(self) -> int:
        return 0


class RadixCache(RequestCacheMixin, BasePrefixCache):
    """``simulated``: a tree without pools (``create_simulated``): slot values are opaque (not
    checked against pages), ``insert`` also takes ``value=None``, and the allocator may be
    None or any object with ``free`` / ``available_size``."""

    def __init__(self, params: CacheInitParams, *, simulated: bool = False):
        if not isinstance(params, CacheInitParams):
            raise TypeError(f"params must be a CacheInitParams, got {type(params).__name__}")
        self.params = params
        self.page_size = params.page_size
        self.disable = params.disable
        self.simulated = simulated
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        alloc = self.token_to_kv_pool_allocator
        if simulated:
            if alloc is None:
                self.token_to_kv_pool_allocator = _DiscardSlots()
        elif alloc is None and not self.disable:
            raise ValueError("CacheInitParams.token_to_kv_pool_allocator is required unless disable=True")
        elif alloc is not None and alloc.page_size != self.page_size:
            raise ValueError(f"allocator page_size {alloc.page_size} != CacheInitParams.page_size {self.page_size}")
        # Slot tensors the tree hands out (match results, node values) are CPU int64 whatever
        # the pool's device: the device is the pool's business.
        self.device = torch.device("cpu")
        self.enable_kv_cache_events = params.enable_kv_cache_events
        on = self.enable_kv_cache_events and not self.disable
        self.kv_events = KVCacheEventRecorder(self.page_size) if on else None
        self.eviction_policy = EvictionPolicy.parse(params.eviction_policy)
        self._priority = eviction_priority(self.eviction_policy, params.eviction_policy_config)
        self._clock = 0
        self._new_root()

    @classmethod
    def create_simulated(cls, disable: bool = False, mock_allocator=None, page_size: int = 1,
                         enable_kv_cache_events: bool = False) -> "RadixCache":
        """A tree without memory pools, for tests and simulations (upstream's): what eviction
        frees goes to ``mock_allocator`` (nowhere when None)."""
        params = CacheInitParams(disable=disable, token_to_kv_pool_allocator=mock_allocator, page_size=page_size,
                                 enable_kv_cache_events=enable_kv_cache_events)
        return cls(params, simulated=True)

    # ---- tree basics -----------------------------------------------------------------------
    def _new_root(self) -> None:
        self.root_node = TreeNode(key=RadixKey(()))
        self.root_node.value = empty_indices()
        self.root_node.hash_value = []
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        if self.kv_events is not None:
            self.kv_events.cleared()

    def reset(self) -> None:
        """Drop every node and return its slots to the allocators. ValueError while a request
        still holds a lock (nothing is dropped then)."""
        if self.protected_size_:
            raise ValueError(f"reset with {self.protected_size_} tokens still locked by requests")
        for node in list(self._all_nodes()):
            self._free_node_slots(node)
        self._new_root()

    def _free_node_slots(self, node: TreeNode) -> None:
        if node.value is not None and node.value.numel():
            self.token_to_kv_pool_allocator.free(node.value)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: RadixKey, pos: int = 0) -> tuple:
        return key.child_key(pos, self.page_size)

    def _attach(self, parent: TreeNode, node: TreeNode) -> None:
        """File ``node`` under ``parent`` as a new child."""
        parent.children[self._child_key(node.key)] = node

    def _all_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_attached(self, node: TreeNode) -> bool:
        while node is not self.root_node:
            parent = node.parent
            if parent is None or parent.children.get(self._child_key(node.key)) is not node:
                return False
            node = parent
        return True

    def _check_attached(self, node, what: str) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: expected a TreeNode, got {type(node).__name__}")
        if not self._is_attached(node):
            raise ValueError(f"{what}: node {node.id} is not in this tree (evicted or from an old tree)")

    def _step(self, node: TreeNode, key: RadixKey, pos: int) -> TreeNode | None:
        """The child of ``node`` matching ``key`` from token ``pos``, split so that it matches
        entirely; None when no child shares the next page."""
        child = node.children.get(key.child_key(pos, self.page_size))  # _child_key, inline: per step per node
        if child is None:
            return None
        n = max(common_prefix_len(child.key.ids, key.ids[pos:], self.page_size), self.page_size)
        if n < len(child.key):
            child = self._split_node(child, n)
        return child

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; return the new upper node. Values, host
        values and hashes are sliced at the same offset; locks and counters are copied; the
        lower part keeps its id (acks refer to it) and its Mamba state (the state at its end)."""
        pages = split_len // self.page_size
        new = TreeNode(parent=child.parent, key=child.key[:split_len].copy())
        for attr in ("lock_ref", "host_ref_counter", "hit_count", "access_count", "last_access_time",
                     "priority"):
            setattr(new, attr, getattr(child, attr))
        if child.value is not None:
            new.value, child.value = child.value[:split_len].clone(), child.value[split_len:].clone()
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:split_len].clone(), child.host_value[split_len:].clone()
        new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        child.parent.children[self._child_key(new.key)] = new
        child.key = child.key[split_len:].copy()
        child.parent = new
        new.children[self._child_key(child.key)] = child
        return new

    # ---- match -----------------------------------------------------------------------------
    @staticmethod
    def _check_key(key) -> RadixKey:
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        return key

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` in whole pages (a trailing partial page never
        matches).

        Mutates: splits the node where the match ends mid-node; refreshes access time and
        count of matched nodes. On a miss: empty ``device_indices`` and the root as last nodes.
        """
        if type(params) is not MatchPrefixParams:
            raise TypeError(f"match_prefix takes MatchPrefixParams(key=...), got {type(params).__name__}")
        key = self._check_key(params.key)
        key = key[: len(key) // self.page_size * self.page_size]
        if self.disable or not len(key):
            return MatchResult(empty_indices(), self.root_node, self.root_node, 0)
        path, node, pos, now = [], self.root_node, 0, self._tick()
        while pos < len(key):
            child = self._step(node, key, pos)
            if child is None:
                break
            child.last_access_time = now
            child.access_count += 1
            path.append(child)
            pos += len(child.key)
            node = child
        result = self._match_result(path)
        result.path = tuple(path)
        return result

    def touch(self, path: tuple[TreeNode, ...]) -> None:
        """What a match does to the nodes it walks, without walking: refresh their access time
        and count (a reused match keeps eviction order exactly as a fresh one would)."""
        now = self._tick()
        for node in path:
            node.last_access_time = now
            node.access_count += 1

    def _match_result(self, path: list[TreeNode]) -> MatchResult:
        last = path[-1] if path else self.root_node
        values = [n.value for n in path]
        device = torch.cat(values) if values else empty_indices()
        return MatchResult(device, last, last, 0)

    # ---- insert ----------------------------------------------------------------------------
    def _check_paged_slots(self, key, slots, op: str, slots_name: str, unit: str) -> tuple[RadixKey, torch.Tensor]:
        """A whole-page ``key`` and one page-aligned slot per token; ValueError naming ``op``."""
        key = self._check_key(key)
        if len(key) % self.page_size:
            raise ValueError(f"{op} key of {len(key)} tokens is not a multiple of page_size {self.page_size}")
        slots = as_cpu_index(slots, slots_name)
        if slots.numel() != len(key):
            raise ValueError(f"{slots_name} has {slots.numel()} {unit} for a key of {len(key)} tokens")
        check_page_aligned(slots, self.page_size, slots_name)
        return key, slots

    def _check_insert(self, params: InsertParams) -> tuple[RadixKey, torch.Tensor]:
        """The whole pages of ``params.key`` and their slots; TypeError / ValueError for a
        missing key, a value of another length, or (real trees) slots that are not whole pages."""
        if type(params) is not InsertParams:
            raise TypeError(f"insert takes InsertParams(key=..., value=...), got {type(params).__name__}")
        key, value = self._check_key(params.key), params.value
        if value is None:
            if not self.simulated:
                raise TypeError("insert: InsertParams.value (one device slot per token) is required")
            value = torch.tensor(key.ids, dtype=torch.int64)  # a copy: the ids are read-only
        n = len(key) // self.page_size * self.page_size
        if self.simulated:
            value = as_cpu_index(value, "insert value")
            if value.numel() != len(key):
                raise ValueError(f"insert value has {value.numel()} slots for a key of {len(key)} tokens")
            return key[:n], value[:n]
        if n != len(key):  # the partial last page stays the caller's
            key, value = key[:n], value[:n]
        return self._check_paged_slots(key, value, "insert", "insert value", "slots")

    def insert(self, params: InsertParams) -> InsertResult:
        """Cache the whole pages of ``params.key`` with device slots ``params.value`` (one per
        token; a trailing partial page is not inserted and its slots stay the caller's).

        Returns ``InsertResult(prefix_len)``: the leading tokens the tree already held on device.
        The caller still owns ``value[:prefix_len]`` and must free those duplicates; the rest of
        the whole pages now belongs to the tree. ``params.chunked``: an insert of a chunked
        prefill, which does not count as a hit. A disabled tree takes nothing (prefix_len 0).
        """
        if self.disable:
            return InsertResult(0)
        return InsertResult(self._insert(*self._check_insert(params), params.chunked, params.priority or 0))

    def _insert(self, key: RadixKey, value: torch.Tensor, chunked: bool, priority: int = 0) -> int:
        """``insert`` of checked whole pages; returns ``prefix_len``. Every node on the path
        keeps the highest ``priority`` inserted through it."""
        node, pos, now, prefix_len, adopting = self.root_node, 0, self._tick(), 0, False
        touched: list[tuple[TreeNode, bool]] = []
        while pos < len(key):
            child = self._step(node, key, pos)
            if child is None:
                break
            n = len(child.key)
            child.last_access_time = now
            child.access_count += 1
            if priority > child.priority:
                child.priority = priority
            if child._value is None and self._insert_existing(child, value[pos : pos + n]):
                adopting = True
            elif adopting:
                raise CacheIntegrityError(f"node {child.id} has a device copy below an evicted node")
            else:
                prefix_len += n
            touched.append((child, False))
            pos, node = pos + n, child
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], value[pos:], now)
            leaf.priority = priority
            touched.append((leaf, True))
        self._on_inserted(touched, chunked)
        return prefix_len

    def _insert_existing(self, node: TreeNode, value: torch.Tensor) -> bool:
        """Hook: an existing node on the insert path that has no device copy (none in this
        tree: it deletes what it evicts); True when it adopts ``value``."""
        return False

    def _on_inserted(self, touched: list[tuple[TreeNode, bool]], chunked: bool) -> None:
        """Hook: the nodes of an insert path, root first, with whether each is new."""

    def _add_leaf(self, parent: TreeNode, key: RadixKey, value: torch.Tensor, now: int) -> TreeNode:
        node = TreeNode(parent=parent, key=key.copy())
        node.value = value.clone()
        node.hash_value = page_hashes(node.key.ids, self.page_size, node.prior_hash())
        node.last_access_time, node.access_count = now, 1
        self._attach(parent, node)
        self.evictable_size_ += len(key)
        if self.kv_events is not None:
            self.kv_events.stored(node)
        return node

    # ---- eviction --------------------------------------------------------------------------
    def _is_device_leaf(self, node: TreeNode) -> bool:
        return node is not self.root_node and node.lock_ref == 0 and not node.children

    def _evict_device_node(self, node: TreeNode) -> int:
        """Hook: evict one unlocked device leaf; return the device tokens freed."""
        self.token_to_kv_pool_allocator.free(node.value, trusted=True)  # validated at insert
        self.evictable_size_ -= len(node.value)
        if self.kv_events is not None:
            self.kv_events.removed(node)
        self._delete_leaf(node)
        return len(node.key)

    def _delete_leaf(self, node: TreeNode) -> None:
        del node.parent.children[node.key.child_key(0, self.page_size)]  # _child_key, inline
        node.stamp = new_stamp()  # gone: a match through it is stale

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device slots from unlocked leaves, policy order
        first. Returns the device tokens freed (less when not enough is evictable)."""
        if type(params) is not EvictParams:
            raise TypeError(f"evict takes EvictParams(num_tokens=...), got {type(params).__name__}")
        return self._evict(params)

    def _evict(self, params: EvictParams) -> EvictResult:
        """Hook: ``evict`` of checked params (hybrid trees also evict Mamba states)."""
        if params.mamba_num:
            raise ValueError(f"{type(self).__name__} holds no Mamba states: EvictParams.mamba_num must be 0")
        return EvictResult(self._evict_tokens(params.num_tokens))

    def _evict_tokens(self, num_tokens: int) -> int:
        """Hook: free at least ``num_tokens`` device slots; returns the slots freed."""
        if self.disable or num_tokens == 0:
            return 0
        heap = [(self._priority(n), n) for n in self._all_nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            freed += self._evict_device_node(node)
            parent = node.parent
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent))
        logger.debug("evict: asked %d tokens, freed %d", num_tokens, freed)
        return freed

    # ---- locks -----------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect ``node`` and its ancestors from eviction. Returns the change of
        ``evictable_size()`` (<= 0). ValueError for a node not in the tree or without device copy."""
        if self.disable:
            return 0
        self._check_attached(node, "inc_lock_ref")
        x = node
        while x is not self.root_node:
            if x.value is None:
                raise ValueError(f"inc_lock_ref: node {x.id} has no device copy to protect")
            x = x.parent
        return self._lock_path(node)

    def _lock_path(self, node: TreeNode) -> int:
        """``inc_lock_ref`` without its checks, for the tree's own locks on a node it knows is
        attached with its ancestors on device (a node just inserted, or one it holds locked):
        the checks walk the path twice more, several times a step (issue 9)."""
        root, delta = self.root_node, 0
        while node is not root:
            if node.lock_ref == 0:
                n = node._value.numel()  # Tensor.__len__ is a Python call
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref``. Returns the change of ``evictable_size()`` (>= 0).
        ValueError when the node (or an ancestor) is not locked; nothing changes then."""
        if self.disable:
            return 0
        self._check_attached(node, "dec_lock_ref")
        x = node
        while x is not self.root_node:
            if x.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref: node {x.id} is not locked")
            x = x.parent
        return self._unlock_path(node)

    def _unlock_path(self, node: TreeNode) -> int:
        """``dec_lock_ref`` without its checks, for the tree's own unlock of a lock it took."""
        root, delta = self.root_node, 0
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = node._value.numel()
                self.evictable_size_ += n
                self.protected_size_ -= n
                delta += n
            node = node.parent
        return delta

    # ---- sizes -----------------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return self.protected_size_

    def total_size(self) -> int:
        """Device tokens in the tree."""
        return self.evictable_size_ + self.protected_size_

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree holds, one int64 tensor (nodes in no particular order)."""
        values = [n.value for n in self._all_nodes() if n.value is not None]
        return torch.cat(values) if values else empty_indices()

    def pretty_print(self) -> None:
        """Print the tree, one node a line indented by depth (tokens, tiers, locks), then the
        device total."""
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root_node:
                tiers = "".join(t for t, v in (("D", node.value), ("H", node.host_value)) if v is not None)
                print(f"{'  ' * (depth - 1)}{node.key!r} [{tiers or '-'}] lock_ref={node.lock_ref} id={node.id}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        print(f"#tokens on device: {self.total_size()}")

    # ---- integrity -------------------------------------------------------------------------
    def _check_node(self, node: TreeNode) -> None:
        """Hook: per-node invariants of a subclass."""
        if node.value is None:
            raise CacheIntegrityError(f"node {node.id} has no device copy in a device-only tree")

    def check_integrity(self, request_device_indices: Iterable[torch.Tensor] = (), check_hashes: bool = True) -> None:
        """Raise CacheIntegrityError unless every device slot is exactly one of free, in the
        tree, or in ``request_device_indices`` (slots held by running requests), and every node
        is consistent (key, value and hash lengths, hash chain, lock counts, size counters)."""
        check_tree_nodes(self, check_hashes)
        if self.disable or self.simulated:  # no pool to account a simulated tree's values against
            return
        owners = {"tree": [n.value for n in self._all_nodes()], "requests": list(request_device_indices)}
        check_slot_partition("device pool", self.token_to_kv_pool_allocator, owners)

    def tree_signature(self) -> list[tuple]:
        """A comparable picture of the tree (paths, tiers, locks) for tests and TP checks."""
        out = []
        for node in self._all_nodes():
            out.append((node.hash_value[-1], len(node.key), node.value is not None, node.host_value is not None,
                        node.lock_ref, node.mamba_value is not None, node.mamba_host_value is not None))
        return sorted(out)
