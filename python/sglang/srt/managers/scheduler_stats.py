"""SchedulerStats: what the scheduler counts, and the snapshot /metrics and /get_server_info read.

Counters only grow (Prometheus counters); pool figures are read at snapshot time. Units:
tokens, except the storage backend's own counters (pages, bytes, operations).

With HiCache, ``hicache`` carries upstream's HiCache figures (``hicache_snapshot``): the
device<->host copies counted when done (``l2``: slots per pool, bytes, durations) under the
tree's labels, and with L3 the storage figures in tokens under the storage labels, derived from
the storage controller's counters (no second count of the same event).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sglang.srt.managers.io_struct import empty_tier_counts
from sglang.srt.managers.schedule_batch import FinishReason, Req
from sglang.srt.mem_cache.controller.storage_controller import PREFETCH_DEFERRED_REASONS, PREFETCH_UNFULFILLED_REASONS


@dataclass
class SchedulerCounters:
    num_requests: int = 0  # finished requests (any reason)
    num_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: dict = field(default_factory=empty_tier_counts)  # prefix tokens reused, by tier
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_idle_checks: int = 0


class SchedulerStats:
    def __init__(self):
        self.counters = SchedulerCounters()

    def on_admitted(self, req: Req) -> None:
        for tier, n in req.cached_tokens.items():
            self.counters.cached_tokens[tier] += n

    def on_finished(self, req: Req) -> None:
        c = self.counters
        c.num_requests += 1
        c.num_aborted += req.finished is not None and req.finished.reason is FinishReason.ABORT
        c.prompt_tokens += len(req.origin_input_ids)
        c.generation_tokens += len(req.output_ids)

    def snapshot(self, scheduler) -> dict:
        """Counters plus queue lengths and pool usage per tier (device, host, storage)."""
        tree = scheduler.tree_cache
        alloc = scheduler.runner.token_to_kv_pool_allocator
        device_total = scheduler.runner.max_total_num_tokens
        pools = {
            "device": {
                "capacity_tokens": device_total,
                "used_tokens": device_total - alloc.available_size(),
                "cached_tokens": tree.total_size() if not tree.disable else 0,
            }
        }
        controller = getattr(tree, "cache_controller", None)
        tiers, hicache = {"l2": {}, "l3": {}}, {}
        if controller is not None:
            host = controller.mem_pool_host
            pools["host"] = {
                "capacity_tokens": host.size,
                "used_tokens": host.size - host.available_size(),
            }
            tiers = controller.get_stats()
            hicache = hicache_snapshot(tree, controller, tiers["l3"])
        return {
            "counters": asdict(self.counters),
            "num_running_reqs": len(scheduler.running) + (scheduler.chunked_req is not None),
            "num_waiting_reqs": len(scheduler.waiting),
            "pools": pools,
            "host_transfers": tiers["l2"],
            "storage": tiers["l3"],
            "hicache": hicache,
            # state models: state slots by holder (MambaStateSlots.stats); None without a state pool
            "mamba": scheduler.mamba.stats() if getattr(scheduler, "mamba", None) is not None else None,
        }


def hicache_snapshot(tree, controller, l3: dict) -> dict:
    """Upstream's HiCache figures of ``tree``'s controller: ``labels`` (upstream's radix cache
    labels), ``l2`` (per direction: ``tokens_by_pool`` with every bound pool, ``bytes``,
    ``duration_seconds``) and, with L3, ``storage`` (``labels``; tokens ``prefetched``, ``hit``,
    ``backuped``; ``unfulfilled`` and ``deferred`` by reason). ``l3``: ``get_stats()["l3"]``."""
    coords = controller.parallel_coords()
    l2 = controller.l2_metrics.snapshot()
    bound = dict.fromkeys((name.value for name in controller.bindings), 0)
    for direction in l2.values():
        direction["tokens_by_pool"] = {**bound, **direction["tokens_by_pool"]}
    out = {"labels": {"cache_type": type(tree).__name__, "tp_rank": coords.tp_rank, "pp_rank": coords.pp_rank,
                      "dp_rank": 0},  # no attention data parallelism here
           "l2": l2}
    if controller.storage is None:
        return out
    page, config = controller.page_size, controller.storage_config
    out["storage"] = {
        "labels": {"storage_backend": controller.storage_backend_name, "tp_rank": config.tp_rank,
                   "dp_rank": config.dp_rank, "pp_rank": config.pp_rank, "pp_size": config.pp_size,
                   "attn_cp_rank": config.attn_cp_rank, "attn_cp_size": config.attn_cp_size},
        "prefetched_tokens": l3.get("prefetch_pages_loaded", 0) * page,
        "hit_tokens": l3.get("prefetch_pages_found", 0) * page,
        "backuped_tokens": (l3.get("backup_pages_submitted", 0) - l3.get("backup_pages_failed", 0)) * page,
        "unfulfilled_tokens": {r: l3.get(f"prefetch_unfulfilled_tokens_{r}", 0) for r in PREFETCH_UNFULFILLED_REASONS},
        "deferred_tokens": {r: l3.get(f"prefetch_deferred_tokens_{r}", 0) for r in PREFETCH_DEFERRED_REASONS},
    }
    return out
