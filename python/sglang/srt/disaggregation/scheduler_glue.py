"""What the Scheduler calls when the server runs in a disaggregation mode.

``build_disaggregation(scheduler)`` returns None in null mode, else a ``PrefillDisagg`` or a
``DecodeDisagg`` (``prefill.py``, ``decode.py``) with this interface, which the scheduler calls
at a few points and which calls back into it (``enqueue``, ``_finish``, ``_cache_unfinished``):

- ``add_request(req, msg) -> bool``: take a new request into the PD queues (True) or leave it
  to the normal waiting queue (False; never in these modes);
- ``step()``: at the start of every scheduler step, poll the queues and move requests on;
- ``intercept_finish(req) -> bool``: the scheduler is about to finish ``req``; True keeps it
  (prefill: its KV is being sent, the pages stay held until the transfer ends);
- ``abort(rid) -> bool``: drop a request held in the PD queues;
- ``held_reqs()``: requests in the PD queues that hold device pages (integrity, reservations);
- ``has_work()``, ``info()``, ``close()``.

Every TP rank runs the same calls on the same messages, and acts on transfer states only after
``agreed_polls`` made them the same on every rank, so all ranks keep identical pools.
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.utils import FirstTokenAux, advertised_host, build_kv_args, transfer_config
from sglang.srt.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)


class DisaggBase:
    """The parts both modes share: the aux buffers, the rank's NixlKVManager, bookkeeping."""

    mode = "null"

    def __init__(self, scheduler, bootstrap_addr: str | None):
        from sglang.srt.disaggregation.base.conn import DisaggregationMode
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager

        self.sched = scheduler
        self.runner = scheduler.runner
        self.page_size = scheduler.page_size
        args = scheduler.args
        self.aux = FirstTokenAux(self.runner.req_to_token_pool.size)
        self.kv_args = build_kv_args(self.runner, self.aux)
        self.host = advertised_host(args.host)
        self.mgr = NixlKVManager(self.kv_args, DisaggregationMode(self.mode),
                                 transfer_config(self.host, bootstrap_addr))
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
        return {"disaggregation_mode": self.mode, "pd_transferred": self.num_transferred,
                "pd_failed": self.num_failed, "pd_active_rooms": self.mgr.num_active_rooms()}

    def close(self) -> None:
        self.mgr.close()


def build_disaggregation(scheduler):
    """The PD helper of ``scheduler`` for its ``--disaggregation-mode`` (None in null mode)."""
    mode = getattr(scheduler.args, "disaggregation_mode", "null")
    if mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillDisagg

        return PrefillDisagg(scheduler)
    if mode == "decode":
        from sglang.srt.disaggregation.decode import DecodeDisagg

        return DecodeDisagg(scheduler)
    return None
