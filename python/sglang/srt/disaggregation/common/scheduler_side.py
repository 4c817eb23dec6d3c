"""DisaggBase: what the prefill and decode modes share on the scheduler side (the first-token
aux buffers, the rank's KV manager of the chosen transfer backend, transfer counters, failing a request).

The scheduler-facing interface both modes implement is described in ``scheduler_glue.py``.
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.utils import (
    FirstTokenAux,
    advertised_host,
    build_kv_args,
    get_kv_class,
    transfer_config,
)
from sglang.srt.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)


class DisaggBase:
    """The parts both modes share: the aux buffers, the rank's KV manager, bookkeeping."""

    mode = "null"

    def __init__(self, scheduler, bootstrap_addr: str | None):
        from sglang.srt.disaggregation.base.conn import DisaggregationMode

        self.sched = scheduler
        self.runner = scheduler.runner
        self.page_size = scheduler.page_size
        args = scheduler.args
        self.aux = FirstTokenAux(self.runner.req_to_token_pool.size)
        self.kv_args = build_kv_args(self.runner, self.aux)
        self.host = advertised_host(args.host)
        self.backend = args.disaggregation_transfer_backend
        manager_cls = get_kv_class(self.backend, "manager")
        self.mgr = manager_cls(self.kv_args, DisaggregationMode(self.mode),
                               transfer_config(self.host, bootstrap_addr, args.disaggregation_ib_device))
        self.num_transferred = 0
        self.num_failed = 0

    def has_work(self) -> bool:
        return bool(self.held_reqs()) or bool(self.queued_reqs())

    def queued_reqs(self) -> list[Req]:
        """Requests in the PD queues that hold no device pages."""
        return []

    def held_reqs(self) -> list[Req]:
        return []

    def fail(self, req: Req, message: str) -> None:
        """Finish ``req`` as aborted with ``message`` (a transfer failure): no tokens are reported,
        so the client gets the message as an error."""
        self.num_failed += 1
        logger.warning("request %s failed in PD transfer: %s", req.rid, message)
        req.finished = None
        req.finish(FinishReason.ABORT, message=f"PD transfer failed: {message}")
        req.output_ids, req.logprobs, req.top_logprobs, req.sent = [], [], [], 0

    def info(self) -> dict:
        return {"disaggregation_mode": self.mode, "pd_transfer_backend": self.backend,
                "pd_transferred": self.num_transferred,
                "pd_failed": self.num_failed, "pd_active_rooms": self.mgr.num_active_rooms()}

    def close(self) -> None:
        self.mgr.close()


def take_state_slot(mamba, req, prompt_len: int) -> bool:
    """Decode: reserve ``req``'s own state slot (``MambaStateSlots.reserve``) for the state prefill
    sends, and make its first forward continue from that slot after ``prompt_len`` tokens.
    False (nothing held) when no slot can be had now."""
    if not mamba.reserve(req):
        return False
    req.mamba_src_idx = int(req.mamba_pool_idx[0])
    req.mamba_computed_len, req.mamba_branch_len = prompt_len, 0
    return True
