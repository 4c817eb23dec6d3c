"""Builders of hybrid HiCache stacks: host pools, HostPoolGroup, controller and tree, together.

One builder per stack:

- ``build_mamba_hybrid_stack``: attention KV (anchor) + Mamba states (own slots) -> HiMambaRadixCache
- ``build_nsa_hybrid_stack``: MLA KV (anchor) + DSA indexer keys (sidecar) -> HiRadixCache
- ``build_dsv4_stack``: DeepSeek-V4 logical anchor (no bytes) + compressed state rows (sidecar)

Every builder reads parallel coordinates from ``params`` (CacheInitParams) and nowhere else; it
hands them to the controller through upstream's keywords (``HybridCacheController.from_params``:
``tp_group``, ``pp_group``, ``attn_cp_group``, ``pp_rank``, ``pp_size``, ``attn_cp_rank``,
``attn_cp_size``, ...) and gives ``params`` to the tree, which checks that the controller's
CacheInitParams agrees: the controller, the tree and the storage config all see the same values.
Upstream's keyword-only builder arguments ``load_cache_event``, ``prefetch_threshold`` and
``enable_storage_metrics`` go to the controller.

Storage (L3): every stack attaches ``config.storage_backend`` and uses ``config.prefetch_policy``
and ``config.prefetch_retry``:
sidecars move with their anchor page; the KV + Mamba stack stores each backed-up node's Mamba
state beside its last page (see ``hi_mamba_storage.py``).

Host sizing: ``hicache_size_gb`` buys anchor slots at the bytes of an anchor slot plus its
sidecars'; for KV + Mamba the budget is split in proportion to the device pools' bytes. Without
it, each pool gets ``hicache_ratio`` times its device slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang.srt.mem_cache.cache_init_params import CacheInitParams, ParallelCoords
from sglang.srt.mem_cache.hi_mamba_radix_cache import HiMambaRadixCache
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool.base import KVCache, PoolKind
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

logger = logging.getLogger(__name__)

ANCHOR_HOST_CLASSES = {
    PoolKind.MHA: MHATokenToKVPoolHost,
    PoolKind.ASYMMETRIC_MHA: AsymmetricMHATokenToKVPoolHost,
    PoolKind.MLA: MLATokenToKVPoolHost,
    PoolKind.DSV4_ANCHOR: LogicalHostPool,
}


@dataclass
class HybridStack:
    params: CacheInitParams
    host_pool_group: HostPoolGroup
    cache_controller: HybridCacheController
    tree_cache: HiRadixCache

    def parallel_coords(self) -> ParallelCoords:
        return self.cache_controller.parallel_coords()


def _anchor_device(params: CacheInitParams, kinds: tuple[PoolKind, ...]) -> KVCache:
    if not isinstance(params, CacheInitParams):
        raise TypeError(f"params must be a CacheInitParams, got {type(params).__name__}")
    alloc = params.token_to_kv_pool_allocator
    if alloc is None:
        raise ValueError("CacheInitParams.token_to_kv_pool_allocator is required to build a HiCache stack")
    pool = alloc.get_kvcache()
    if pool.kind not in kinds:
        raise ValueError(f"anchor device pool is {pool.kind.value}; this stack needs one of {[k.value for k in kinds]}")
    return pool


def _check_sidecar(anchor: KVCache, side: KVCache, kind: PoolKind) -> None:
    if side.kind is not kind:
        raise TypeError(f"expected a {kind.value} device pool, got {type(side).__name__}")
    if (side.size, side.page_size) != (anchor.size, anchor.page_size):
        raise ValueError(
            f"{kind.value} pool has {side.size} slots / page {side.page_size}; the anchor has "
            f"{anchor.size} / {anchor.page_size} (a sidecar uses the anchor's slots)"
        )


def _anchor_host_slots(config: HiCacheConfig, anchor: KVCache, sidecars: list[KVCache]) -> int:
    if config.hicache_size_gb > 0:
        per_slot = anchor.get_size_per_token() + sum(s.get_size_per_token() for s in sidecars)
        slots = int(config.hicache_size_gb * 1e9) // per_slot
    else:
        slots = int(anchor.size * config.hicache_ratio)
    return slots // anchor.page_size * anchor.page_size


def _controller(params: CacheInitParams, group: HostPoolGroup, config: HiCacheConfig, io,
                controller_kwargs: dict) -> HybridCacheController:
    """The stack's controller: ``params`` handed over through upstream's keywords, the
    ``--hicache-*`` settings from ``config``; ``controller_kwargs``: the builder's keyword-only
    arguments (``load_cache_event``, ``prefetch_threshold``, ``enable_storage_metrics``)."""
    return HybridCacheController.from_params(params, group, write_policy=config.write_policy, io_backend=io,
                                             **config.storage_kwargs, **controller_kwargs)


def _sidecar_stack(params, config, anchor_kinds, side_pool, side_kind, side_name, side_cls,
                   controller_kwargs) -> HybridStack:
    config = config or HiCacheConfig()
    anchor = _anchor_device(params, anchor_kinds)
    _check_sidecar(anchor, side_pool, side_kind)
    slots = _anchor_host_slots(config, anchor, [side_pool])
    io = config.io_backend
    if anchor.kind is PoolKind.DSV4_ANCHOR:  # slots only: upstream's LogicalHostPool(size, page_size, layout)
        anchor_host = LogicalHostPool(slots, anchor.page_size, config.mem_layout, io_backend=io)
    else:
        anchor_host = ANCHOR_HOST_CLASSES[anchor.kind](anchor, layout=config.mem_layout, io_backend=io, size=slots)
    side_host = side_cls(side_pool, anchor_host, io)
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, anchor_host, anchor, is_primary_index_anchor=True),
        PoolEntry(side_name, side_host, side_pool, shares_anchor_slots=True),
    ])
    controller = _controller(params, group, config, io, controller_kwargs)
    tree = HiRadixCache(params, controller, config.load_back_threshold, config.prefetch_policy, config.prefetch_retry)
    return HybridStack(params, group, controller, tree)


def build_nsa_hybrid_stack(params: CacheInitParams, indexer_pool, config: HiCacheConfig | None = None, *,
                           load_cache_event=None, prefetch_threshold: int = 256,
                           enable_storage_metrics: bool = False) -> HybridStack:
    """MLA KV anchor + DSA indexer sidecar (same slots, moved together)."""
    return _sidecar_stack(params, config, (PoolKind.MLA,), indexer_pool, PoolKind.DSA_INDEXER, PoolName.INDEXER,
                          lambda pool, anchor_host, io: DSAIndexerPoolHost(pool, anchor_host, anchor_host.layout,
                                                                           io_backend=io),
                          dict(load_cache_event=load_cache_event, prefetch_threshold=prefetch_threshold,
                               enable_storage_metrics=enable_storage_metrics))


def build_dsv4_stack(params: CacheInitParams, state_pool, config: HiCacheConfig | None = None, *,
                     load_cache_event=None, prefetch_threshold: int = 256,
                     enable_storage_metrics: bool = False) -> HybridStack:
    """DeepSeek-V4: a logical anchor (slots, no bytes) + the compressed-state sidecar."""
    return _sidecar_stack(params, config, (PoolKind.DSV4_ANCHOR,), state_pool, PoolKind.DSV4_STATE,
                          PoolName.DSV4_STATE,
                          lambda pool, anchor_host, io: DeepSeekV4StateHostPool(
                              PoolName.DSV4_STATE.value, [pool], anchor_host.page_num, anchor_host.page_size,
                              anchor_host.layout, io_backend=io),
                          dict(load_cache_event=load_cache_event, prefetch_threshold=prefetch_threshold,
                               enable_storage_metrics=enable_storage_metrics))


def build_mamba_hybrid_stack(params: CacheInitParams, mamba_pool, config: HiCacheConfig | None = None, *,
                             load_cache_event=None, prefetch_threshold: int = 256,
                             enable_storage_metrics: bool = False) -> HybridStack:
    """Attention KV anchor + Mamba states (own slots, one per cached state) -> HiMambaRadixCache."""
    config = config or HiCacheConfig()
    anchor = _anchor_device(params, (PoolKind.MHA, PoolKind.MLA, PoolKind.ASYMMETRIC_MHA))
    if getattr(mamba_pool, "kind", None) is not PoolKind.MAMBA:
        raise TypeError(f"expected a MambaPool, got {type(mamba_pool).__name__}")
    io = config.io_backend
    if config.hicache_size_gb > 0:
        kv_bytes, mamba_bytes = anchor.mem_usage_bytes(), mamba_pool.mem_usage_bytes()
        kv_gb = config.hicache_size_gb * kv_bytes / (kv_bytes + mamba_bytes)
        kv_host = ANCHOR_HOST_CLASSES[anchor.kind](anchor, 0, kv_gb, layout=config.mem_layout, io_backend=io)
        mamba_host = MambaPoolHost(mamba_pool, 0, config.hicache_size_gb - kv_gb, io_backend=io)
    else:
        kv_host = ANCHOR_HOST_CLASSES[anchor.kind](anchor, config.hicache_ratio, layout=config.mem_layout, io_backend=io)
        mamba_host = MambaPoolHost(mamba_pool, config.hicache_ratio, io_backend=io)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv_host, anchor, is_primary_index_anchor=True),
                           PoolEntry(PoolName.MAMBA, mamba_host, mamba_pool)])
    controller = _controller(params, group, config, io, dict(
        load_cache_event=load_cache_event, prefetch_threshold=prefetch_threshold,
        enable_storage_metrics=enable_storage_metrics))
    tree = HiMambaRadixCache(params, controller, config.load_back_threshold, config.prefetch_policy,
                             config.prefetch_retry)
    return HybridStack(params, group, controller, tree)
