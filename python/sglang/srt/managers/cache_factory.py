"""Build the scheduler's prefix cache from ServerArgs and the model runner's pools.

``RadixCache`` over the device pool (``MambaRadixCache`` when the model has a state pool), disabled
with ``--disable-radix-cache``; with
``--enable-hierarchical-cache`` a ``HiRadixCache`` whose controller owns the host pools and,
with ``--hicache-storage-backend``, an L3 backend.

Which host pools and which stack come from the pool kinds the model runner built (the model
class states them, ``kv_pool_spec.py``), through two tables and no model names:
``ANCHOR_HOST_CLASSES`` (anchor kind -> host pool) and ``HYBRID_STACK_BUILDERS`` (side pool kind
-> the builder of its stack in ``hybrid_pool_assembler``).
"""

from __future__ import annotations

import logging

from sglang.srt.distributed import get_attn_cp_group, get_pp_group, get_tp_group
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hicache_auto_size import auto_size_hicache
from sglang.srt.mem_cache.hiradix.tp_agreement import TPAgreement
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    ANCHOR_HOST_CLASSES,
    build_dsv4_stack,
    build_nsa_hybrid_stack,
    build_mamba_hybrid_stack,
)
from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.checkpoint_fingerprint import storage_model_name

logger = logging.getLogger(__name__)

# Side pool kind -> builder of the hybrid stack around it (HostPoolGroup + controller + tree).
HYBRID_STACK_BUILDERS = {
    PoolKind.DSA_INDEXER: build_nsa_hybrid_stack,
    PoolKind.DSV4_STATE: build_dsv4_stack,
    PoolKind.MAMBA: build_mamba_hybrid_stack,
}


def cache_init_params(args, runner) -> CacheInitParams:
    return CacheInitParams(
        page_size=args.page_size,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        req_to_token_pool=runner.req_to_token_pool,
        disable=args.disable_radix_cache,
        eviction_policy=args.radix_eviction_policy,
        eviction_policy_config=args.eviction_policy_config,
        tp_rank=runner.tp_rank,
        tp_size=runner.tp_size,
        tp_cache_group=get_tp_group().cpu_group,
        pp_cache_group=get_pp_group().cpu_group,  # pp_rank / pp_size read from it (0 / 1 without PP)
        attn_cp_cache_group=get_attn_cp_group().cpu_group,  # attn_cp_rank / attn_cp_size likewise
        # rank 0 publishes; the other ranks hold the same tree and record nothing
        enable_kv_cache_events=(bool(getattr(args, "kv_events_config", None)) and runner.tp_rank == 0
                                and getattr(runner, "pp_rank", 0) == 0 and getattr(runner, "attn_cp_rank", 0) == 0),
    )


def _storage_flags_error(args, exc: ValueError) -> ValueError:
    return ValueError(
        f"--hicache-storage-backend {args.hicache_storage_backend} / --hicache-storage-backend-extra-config: {exc}"
    )


def host_ratio(args, runner, params: CacheInitParams) -> float:
    """The host-to-device ratio of the host pools: --hicache-ratio as given, or (neither it nor
    --hicache-size given) its default lowered to fit --hicache-host-memory-fraction of this host's
    memory for the bytes of every device pool that gets a host mirror, agreed (MIN) over the TP
    ranks. Every TP rank calls it, before any host pool is built."""
    fraction = args.resolved_host_memory_fraction
    if fraction is None:
        return args.resolved_hicache_ratio
    device_bytes = sum(pool.mem_usage_bytes() for pool in runner.all_pools)
    # our TP x PP ranks all run on this host: the budget is split over them
    return auto_size_hicache(args.resolved_hicache_ratio, fraction, device_bytes,
                             ranks_per_host=params.tp_size * params.pp_size * params.attn_cp_size,
                             agree_min=TPAgreement(params.tp_cache_group, params.pp_cache_group,
                                                   params.attn_cp_cache_group).min,
                             tp_rank=params.tp_rank + (params.pp_rank + params.attn_cp_rank) * params.tp_size)


def hicache_config(args, hicache_ratio: float | None = None) -> HiCacheConfig:
    """The --hicache-* flags as a HiCacheConfig (``hicache_ratio``: the sized ratio, default the
    flag's); a bad storage option names the flags."""
    storage = args.hicache_storage_backend is not None
    # the weights' fingerprint, not the name alone: other weights never read these pages
    storage_model = storage_model_name(args) if storage else None
    try:
        return HiCacheConfig(
            write_policy=args.hicache_write_policy,
            hicache_ratio=args.resolved_hicache_ratio if hicache_ratio is None else hicache_ratio,
            hicache_size_gb=args.hicache_size,
            mem_layout=args.hicache_mem_layout,
            io_backend=args.resolved_io_backend,
            storage_backend=args.hicache_storage_backend,
            storage_backend_extra_config=dict(args.storage_extra_config) if storage else None,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            prefetch_retry_poll_interval=args.hicache_storage_prefetch_retry_poll_interval,
            prefetch_retry_max_attempts=args.hicache_storage_prefetch_retry_max_attempts,
            model_name=storage_model,
        )
    except ValueError as exc:
        raise _storage_flags_error(args, exc) if storage else exc from None


def _controller(args, params, host_pool, cfg: HiCacheConfig) -> HiCacheController:
    """The controller, with its L3 backend when asked; a bad backend option names the flags."""
    try:
        return HiCacheController.from_params(params, host_pool, write_policy=cfg.write_policy,
                                             io_backend=cfg.io_backend, **cfg.storage_kwargs)
    except ValueError as exc:
        if cfg.storage_backend is None:
            raise
        raise _storage_flags_error(args, exc) from None


def check_host_cells(args, runner) -> None:
    """Every pool the model caches into supports --hicache-mem-layout + --hicache-io-backend;
    ValueError naming the pool and its supported cells otherwise."""
    from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend

    cell = (HostLayout(args.hicache_mem_layout).value, IOBackend(args.resolved_io_backend).value)
    for pool in runner.all_pools:
        cells = supported_cells(pool.kind)
        if cell not in cells:
            raise ValueError(
                f"--hicache-mem-layout {cell[0]} with --hicache-io-backend {cell[1]} is not supported by this "
                f"model's {pool.kind.value} pool ({type(pool).__name__}); supported layout+io_backend: "
                + ", ".join(f"{lay}+{io}" for lay, io in cells)
            )


def _side_pool(runner):
    """(kind, pool) of the runner's one side pool (sidecar or state pool), or None."""
    sides = [*runner.side_pools.items()]
    if runner.state_pool is not None:
        sides.append((runner.state_pool.kind, runner.state_pool))
    if len(sides) > 1:
        raise ValueError(f"no HiCache stack for side pools {[k.value for k, _ in sides]}; one is supported")
    return sides[0] if sides else None


def build_tree_cache(args, runner) -> RadixCache:
    """The prefix cache for ``runner``'s pools, as ``args`` asks. ValueError on a bad combination."""
    side = _side_pool(runner)
    # Sidecars share the anchor's slots, so a device-only RadixCache frees them with the anchor; an
    # own-slot state pool needs a tree that keeps states (MambaRadixCache, HiMambaRadixCache on HiCache).
    state = runner.state_pool
    params = cache_init_params(args, runner)
    if not args.enable_hierarchical_cache:
        if state is not None and not args.disable_radix_cache:
            logger.info("prefix cache: MambaRadixCache (device only, %d state slots)", state.size)
            return MambaRadixCache(params, state)
        logger.info("prefix cache: %s", "disabled" if args.disable_radix_cache else "RadixCache (device only)")
        return RadixCache(params)
    check_host_cells(args, runner)
    cfg = hicache_config(args, host_ratio(args, runner, params))
    anchor = runner.token_to_kv_pool
    if side is not None:
        try:
            stack = HYBRID_STACK_BUILDERS[side[0]](params, side[1], cfg)
        except ValueError as exc:
            if cfg.storage_backend is None:
                raise
            raise _storage_flags_error(args, exc) from None
        tree, host_pool = stack.tree_cache, stack.host_pool_group
    else:
        host_pool = ANCHOR_HOST_CLASSES[anchor.kind](
            anchor,
            host_to_device_ratio=cfg.hicache_ratio,
            host_size=cfg.hicache_size_gb,
            page_size=args.page_size,
            layout=cfg.mem_layout,
            io_backend=cfg.io_backend,
        )
        controller = _controller(args, params, host_pool, cfg)
        tree = HiRadixCache(params, controller, cfg.load_back_threshold, prefetch_stop_policy=cfg.prefetch_policy,
                            prefetch_retry=cfg.prefetch_retry)
    logger.info(
        "prefix cache: %s, pools %s, host %d slots (%s, %s), write policy %s, storage %s",
        type(tree).__name__, " + ".join(p.kind.value for p in runner.all_pools), host_pool.size,
        cfg.mem_layout.value, cfg.io_backend.value, cfg.write_policy.value, args.hicache_storage_backend or "none",
    )
    return tree


def storage_controller_of(tree):
    """The L2<->L3 side of ``tree``'s controller (``StorageController``), or None."""
    controller = getattr(tree, "cache_controller", None)
    return getattr(controller, "storage", None)


def controller_report(tree) -> dict | None:
    """This rank's HiCache controller as /get_server_info shows it (None without HiCache): its
    class, the parallel coordinates it took from CacheInitParams and those its storage config
    carries (the L3 namespace is built from them)."""
    controller = getattr(tree, "cache_controller", None)
    if controller is None:
        return None
    config = getattr(controller, "storage_config", None)
    return {
        "class": type(controller).__name__,
        "attn_cp_rank_and_size": list(controller.get_attn_cp_rank_and_size()),
        "pp_rank": controller.params.pp_rank, "pp_size": controller.params.pp_size,
        "storage_config": None if config is None else {
            name: getattr(config, name) for name in ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank",
                                                     "attn_cp_size")},
    }


def storage_enabled(tree) -> bool:
    """The tree prefetches from and backs up to L3."""
    return storage_controller_of(tree) is not None
