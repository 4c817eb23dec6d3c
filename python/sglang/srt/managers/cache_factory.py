"""Build the scheduler's prefix cache from ServerArgs and the model runner's pools.

``RadixCache`` over the device pool, disabled with ``--disable-radix-cache``; with
``--enable-hierarchical-cache`` a ``HiRadixCache`` whose ``HiCacheController`` owns a host
pool (``MHATokenToKVPoolHost``) and, with ``--hicache-storage-backend``, an L3 backend.
"""

from __future__ import annotations

import logging

from sglang.srt.distributed import get_tp_group
from sglang.srt.mem_cache.cache_controller import HiCacheController
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)


def cache_init_params(args, runner) -> CacheInitParams:
    return CacheInitParams(
        page_size=args.page_size,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        req_to_token_pool=runner.req_to_token_pool,
        disable=args.disable_radix_cache,
        eviction_policy=args.radix_eviction_policy,
        tp_rank=runner.tp_rank,
        tp_size=runner.tp_size,
        tp_cache_group=get_tp_group().cpu_group,
    )


def _storage_flags_error(args, exc: ValueError) -> ValueError:
    return ValueError(
        f"--hicache-storage-backend {args.hicache_storage_backend} / --hicache-storage-backend-extra-config: {exc}"
    )


def hicache_config(args) -> HiCacheConfig:
    """The --hicache-* flags as a HiCacheConfig; a bad storage option names the flags."""
    storage = args.hicache_storage_backend is not None
    try:
        return HiCacheConfig(
            write_policy=args.hicache_write_policy,
            hicache_ratio=args.hicache_ratio,
            hicache_size_gb=args.hicache_size,
            mem_layout=args.hicache_mem_layout,
            io_backend=args.resolved_io_backend,
            storage_backend=args.hicache_storage_backend,
            storage_backend_extra_config=dict(args.storage_extra_config) if storage else None,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            model_name=args.model_name if storage else None,
        )
    except ValueError as exc:
        raise _storage_flags_error(args, exc) if storage else exc from None


def _controller(args, params, host_pool, cfg: HiCacheConfig) -> HiCacheController:
    """The controller, with its L3 backend when asked; a bad backend option names the flags."""
    try:
        return HiCacheController(params, host_pool, cfg.write_policy, cfg.io_backend, **cfg.storage_kwargs)
    except ValueError as exc:
        if cfg.storage_backend is None:
            raise
        raise _storage_flags_error(args, exc) from None


def build_tree_cache(args, runner) -> RadixCache:
    """The prefix cache for ``runner``'s pools, as ``args`` asks. ValueError on a bad combination."""
    params = cache_init_params(args, runner)
    if not args.enable_hierarchical_cache:
        logger.info("prefix cache: %s", "disabled" if args.disable_radix_cache else "RadixCache (device only)")
        return RadixCache(params)
    cfg = hicache_config(args)
    host_pool = MHATokenToKVPoolHost(
        runner.token_to_kv_pool,
        host_to_device_ratio=cfg.hicache_ratio,
        host_size_gb=cfg.hicache_size_gb,
        page_size=args.page_size,
        layout=cfg.mem_layout,
        io_backend=cfg.io_backend,
    )
    controller = _controller(args, params, host_pool, cfg)
    tree = HiRadixCache(params, controller, cfg.load_back_threshold, prefetch_stop_policy=cfg.prefetch_policy)
    logger.info(
        "prefix cache: HiRadixCache, host pool %d tokens (%s, %s), write policy %s, storage %s",
        host_pool.size, cfg.mem_layout.value, cfg.io_backend.value, cfg.write_policy.value,
        args.hicache_storage_backend or "none",
    )
    return tree


def storage_controller_of(tree):
    """The L2<->L3 side of ``tree``'s controller (``StorageController``), or None."""
    controller = getattr(tree, "cache_controller", None)
    return getattr(controller, "storage", None)


def storage_enabled(tree) -> bool:
    """The tree prefetches from and backs up to L3."""
    return storage_controller_of(tree) is not None
