"""The L3 side of HiMambaRadixCache: each node's Mamba state stored beside its KV pages.

A state is the state after a node's last token; L3 keeps it under the node's last page hash, as
the trailing sidecar of the KV pages (pool ``mamba``, hit policy TRAILING_PAGES), so a stored
prefix is usable exactly up to a page that has a state after it.

- Backup: ``_backup_states`` adds the host state of every backed-up node to the backup of its
  pages (``storage_controller.py`` stores them in the same call, or alone when the pages were
  already stored without it).
- Prefetch (``hiradix_storage.py``): the agreed hit is the longest prefix whose state is stored,
  KV pages are read first, then the state after the last one; a missing state means no hit
  (KV is never inserted without the state that ends it).
- Insert: fetched pages become host copies, which must extend the backed-up prefix from the
  root. So a prefetch starts at a backed-up node (``prefetch_from_storage`` climbs to one and
  also asks for the tokens in between), device nodes on the way without a host copy adopt the
  fetched pages as theirs, and the node ending at the key takes the state unless it has one.

A mixin of HiMambaRadixCache (it uses the tree's ``storage``, ``_step``, ``_new_host_leaf``,
``_checked_host_insert`` and ``cache_controller``).
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.managers.cache_controller import Tier
from sglang.srt.mem_cache.radix.events import StorageMedium
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.controller.storage_ops import PrefetchOperation
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import as_cpu_index

logger = logging.getLogger(__name__)

MAMBA = PoolName.MAMBA


class MambaStorageMixin:
    STORAGE_STATE_POOL = MAMBA

    def prefetch_from_storage(self, req_id: str, last_host_node: TreeNode, new_input_tokens, last_hash=None,
                              prefix_keys=None, extra_key: str | None = None) -> int:
        """HiRadixCache.prefetch_from_storage. When ``last_host_node`` has no host copy, the
        prefetch starts at its deepest backed-up ancestor (or the root) and also asks for the
        tokens in between; the returned count includes them."""
        if self.storage is None:
            return 0
        self._check_attached(last_host_node, "prefetch_from_storage")
        extra_key, _ = self._prefetch_namespace(last_host_node, extra_key, last_hash)
        start, between = last_host_node, []
        while start is not self.root_node and not start.backuped:
            between.append(start.key.token_ids)
            start = start.parent
        tokens = [t for ids in reversed(between) for t in ids] + [int(t) for t in new_input_tokens]
        return super().prefetch_from_storage(req_id, start, tokens, None, prefix_keys, extra_key)

    def insert_host(self, key: RadixKey, host_indices, mamba_host_value=None) -> int:
        """Cache ``key`` (whole pages) on host with ``host_indices`` (one host slot per token)
        and ``mamba_host_value`` (one host Mamba slot: the state after ``key``, or None).

        Returns the leading tokens the tree already held on host: the caller still owns
        ``host_indices[:returned]`` and frees them. The rest is the tree's: new host-only nodes,
        or host copies of device nodes that had none. The state's ownership passes to the tree:
        kept by the node ending at ``key`` when it has no host state, freed otherwise. On
        ValueError nothing changed and the caller keeps everything."""
        key, host = self._checked_host_insert(key, host_indices)
        state = None
        if mamba_host_value is not None:
            state = as_cpu_index(mamba_host_value, "mamba_host_value")
            if state.numel() != 1:
                raise ValueError(f"mamba_host_value must be one slot, got {state.numel()}")
        return self._insert_host_with_state(self.root_node, key, host, state)

    def _insert_host_from(self, node: TreeNode, key: RadixKey, host: torch.Tensor) -> int:
        return self._insert_host_with_state(node, key, host, None)

    def _insert_prefetched(self, op: PrefetchOperation, keep: int) -> tuple[int, bool]:
        key = RadixKey(op.tokens[:keep], op.extra_key)
        return self._insert_host_with_state(op.last_node, key, op.host_indices[:keep], op.state_host), True

    def _insert_host_with_state(self, node: TreeNode, key: RadixKey, host: torch.Tensor,
                                state: torch.Tensor | None) -> int:
        """insert_host after ``node`` (attached; backed up or the root). Backed-up nodes come
        first on any path (a contiguous prefix), so the tokens they hold are a prefix of ``key``."""
        pos, dup, now = 0, 0, self._tick()
        while pos < len(key):
            child = self._step(node, key, pos)
            if child is None:
                break
            n = len(child.key)
            if child.backuped:
                if dup != pos:
                    raise CacheIntegrityError(f"node {child.id} is backed up below a node without a host copy")
                dup += n
            else:
                child.host_value = host[pos : pos + n].clone()
                if self.kv_events is not None:
                    self.kv_events.stored(child, StorageMedium.CPU)
            child.last_access_time = now
            pos, node = pos + n, child
        if pos < len(key):
            node = self._new_host_leaf(node, key[pos:], host[pos:], now)
        if state is not None:
            if len(key) and node.mamba_host_value is None:
                node.mamba_host_value = state.clone()
            else:
                self.cache_controller.free(Tier.HOST, MAMBA, state)
        return dup

    def _backup_states(self, nodes: list[TreeNode]) -> list[tuple[int, torch.Tensor]]:
        out, pages = [], 0
        for n in nodes:
            pages += len(n.hash_value)
            if n.mamba_host_value is not None:
                out.append((pages - 1, n.mamba_host_value))
        return out
