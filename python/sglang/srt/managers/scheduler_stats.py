"""SchedulerStats: what the scheduler counts, and the snapshot /metrics and /get_server_info read.

Counters only grow (Prometheus counters); pool figures are read at snapshot time. Units:
tokens, except the storage backend's own counters (pages, bytes, operations).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sglang.srt.managers.io_struct import empty_tier_counts
from sglang.srt.managers.schedule_batch import FinishReason, Req


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
        tiers = {"l2": {}, "l3": {}}
        if controller is not None:
            host = controller.mem_pool_host
            pools["host"] = {
                "capacity_tokens": host.size,
                "used_tokens": host.size - host.available_size(),
            }
            tiers = controller.get_stats()
        return {
            "counters": asdict(self.counters),
            "num_running_reqs": len(scheduler.running) + (scheduler.chunked_req is not None),
            "num_waiting_reqs": len(scheduler.waiting),
            "pools": pools,
            "host_transfers": tiers["l2"],
            "storage": tiers["l3"],
        }
