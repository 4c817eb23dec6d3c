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
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolName

logger = logging.getLogger(__name__)


class HybridCacheController(HiCacheController):
    """Upstream's constructor: ``mem_pool_host`` is the HostPoolGroup (kept as
    ``self.mem_pool_host`` and ``self.host_pool_group``), whose anchor must mirror the device
    pool behind ``token_to_kv_pool_allocator``; its own-slot side pools must be allocators
    (``alloc``/``free``/``available_size``) on both tiers. Every other keyword is
    HiCacheController's (the coordinates end up in ``self.params`` and the storage config).

    ``transfer_layer_num`` (upstream's earlier name; ``transfer_layer_id_max`` is today's): layer
    events per load batch, at least the deepest pool's layer count (the default); layers past a
    pool's own count are skipped for it.
    """

    def __init__(self, token_to_kv_pool_allocator, mem_pool_host: HostPoolGroup, page_size: int, tp_group=None,
                 load_cache_event=None, attn_cp_group=None, attn_tp_group=None, pp_group=None,
                 write_policy="write_through_selective", io_backend="", storage_backend: str | None = None,
                 prefetch_threshold: int = 256, model_name: str | None = None,
                 storage_backend_extra_config: dict | str | None = None, transfer_layer_id_max: int | None = None,
                 enable_storage_metrics: bool = False, host_memory_mode: str = "cache", *,
                 pp_rank: int | None = None, pp_size: int | None = None, attn_cp_rank: int | None = None,
                 attn_cp_size: int | None = None, tp_rank: int | None = None, tp_size: int | None = None,
                 transfer_layer_num: int | None = None):
        if not isinstance(mem_pool_host, HostPoolGroup):
            raise TypeError(f"mem_pool_host must be a HostPoolGroup, got {type(mem_pool_host).__name__}")
        allocator = token_to_kv_pool_allocator
        if allocator is None or mem_pool_host.anchor_entry.device_pool is not allocator.get_kvcache():
            raise ValueError("the group's anchor device pool is not the pool of token_to_kv_pool_allocator")
        if None not in (transfer_layer_num, transfer_layer_id_max) and transfer_layer_num != transfer_layer_id_max:
            raise ValueError(f"transfer_layer_num={transfer_layer_num} and transfer_layer_id_max="
                             f"{transfer_layer_id_max} name one count; give one")
        self.host_pool_group = mem_pool_host
        self._layer_num_asked = transfer_layer_num if transfer_layer_num is not None else transfer_layer_id_max
        super().__init__(
            token_to_kv_pool_allocator, mem_pool_host, page_size, tp_group, load_cache_event, attn_cp_group,
            attn_tp_group, pp_group, write_policy, io_backend, storage_backend, prefetch_threshold, model_name,
            storage_backend_extra_config, enable_storage_metrics, host_memory_mode, pp_rank=pp_rank,
            pp_size=pp_size, attn_cp_rank=attn_cp_rank, attn_cp_size=attn_cp_size, tp_rank=tp_rank, tp_size=tp_size,
        )

    def _pool_bindings(self) -> tuple[PoolName, dict[PoolName, PoolBinding]]:
        group = self.host_pool_group
        anchor = group.anchor_entry
        together = [anchor, *group.sidecars()]
        bindings = {anchor.name: PoolBinding([(e.host_pool, e.device_pool) for e in together], anchor.host_pool,
                                             self.mem_pool_device_allocator)}
        for entry in group.entries:
            if entry is anchor or entry.shares_anchor_slots:
                continue
            for obj in (entry.host_pool, entry.device_pool):
                if not all(hasattr(obj, m) for m in ("alloc", "free", "available_size")):
                    raise TypeError(f"pool {entry.name.value!r}: {type(obj).__name__} cannot hand out slots")
            bindings[entry.name] = PoolBinding([(entry.host_pool, entry.device_pool)], entry.host_pool,
                                               entry.device_pool)
        return anchor.name, bindings

    def _transfer_layer_num(self, deepest_pool_layers: int) -> int:
        asked = self._layer_num_asked
        if asked is None:
            return deepest_pool_layers
        if asked < deepest_pool_layers:
            raise ValueError(f"transfer_layer_num {asked} is below the deepest pool's {deepest_pool_layers} layers")
        return asked

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
