"""HybridCacheController: the L1<->L2 controller over every pool of a HostPoolGroup.

The anchor pool's slots are what the tree tracks; sidecars (DSA indexer, DeepSeek-V4 state) are
addressed with the same slots, so a transfer of anchor pages moves the sidecars' pages too.
Pools with slots of their own (Mamba: one per state) get their own binding and their own
transfers, and share the same lanes, acks and layer events as the anchor.

Storage (L3): the backend registers the whole group; every sidecar moves with each anchor page
through the v2 API (``batch_*_v2`` with one PoolTransfer per pool, the anchor's slots). The
Mamba pool (own slots) is L3's trailing state pool: one state per backed-up node, stored under
the node's last page hash, found with the TRAILING_PAGES hit policy (``storage_controller.py``).
Other pools with slots of their own cannot be attached to L3.
"""

from __future__ import annotations

import logging

from sglang.srt.managers.cache_controller import HiCacheController, PoolBinding
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolName

logger = logging.getLogger(__name__)


class HybridCacheController(HiCacheController):
    """``host_pool_group``'s anchor must mirror the device pool behind
    ``params.token_to_kv_pool_allocator``; its own-slot side pools must be allocators
    (``alloc``/``free``/``available_size``) on both tiers."""

    def __init__(self, params: CacheInitParams, host_pool_group: HostPoolGroup, write_policy="write_through",
                 io_backend=None, storage_backend: str | None = None, storage_backend_extra_config=None,
                 model_name: str | None = None):
        if not isinstance(host_pool_group, HostPoolGroup):
            raise TypeError(f"host_pool_group must be a HostPoolGroup, got {type(host_pool_group).__name__}")
        anchor = host_pool_group.anchor_entry
        allocator = params.token_to_kv_pool_allocator
        if allocator is None or anchor.device_pool is not allocator.get_kvcache():
            raise ValueError("the group's anchor device pool is not the pool of CacheInitParams' allocator")
        together = [anchor, *host_pool_group.sidecars()]
        bindings = {anchor.name: PoolBinding([(e.host_pool, e.device_pool) for e in together], anchor.host_pool, allocator)}
        for entry in host_pool_group.entries:
            if entry is anchor or entry.shares_anchor_slots:
                continue
            for obj in (entry.host_pool, entry.device_pool):
                if not all(hasattr(obj, m) for m in ("alloc", "free", "available_size")):
                    raise TypeError(f"pool {entry.name.value!r}: {type(obj).__name__} cannot hand out slots")
            bindings[entry.name] = PoolBinding([(entry.host_pool, entry.device_pool)], entry.host_pool, entry.device_pool)
        self.host_pool_group = host_pool_group
        super().__init__(params, anchor.host_pool, write_policy, io_backend, bindings, anchor.name,
                         storage_backend, storage_backend_extra_config, model_name)

    def _storage_host(self):
        return self.host_pool_group

    def _storage_side_pools(self) -> list[PoolName]:
        if self.anchor_name is not PoolName.KV:
            raise ValueError(f"L3 storage needs the anchor pool to be named 'kv', got {self.anchor_name.value!r}")
        return [e.name for e in self.host_pool_group.sidecars()]

    def _storage_state_pool(self) -> PoolName | None:
        own = [e.name for e in self.host_pool_group.entries
               if e is not self.host_pool_group.anchor_entry and not e.shares_anchor_slots]
        if not own:
            return None
        if own != [PoolName.MAMBA]:
            raise ValueError(f"L3 storage supports one pool with its own slots, 'mamba'; this group has "
                             f"{', '.join(n.value for n in own)}; start without a storage backend")
        return PoolName.MAMBA
