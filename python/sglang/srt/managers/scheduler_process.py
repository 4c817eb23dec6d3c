"""The scheduler process of one rank: start-up report, then the receive / step loop.

A server has ``tp_size x pp_size`` ranks (global rank ``pp_rank * tp_size + tp_rank``). Rank 0
takes messages from the tokenizer manager's queue and broadcasts them to every rank over the
world group's gloo ``cpu_group``, so all ranks (every TP rank of every pipeline stage) apply the
same messages in the same order and stay in lockstep; only rank 0 sends outputs back. Rank 0 also picks the sampling seed of
requests that have none before the broadcast, so every rank samples with the same noise.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import random
import sys
import traceback

from sglang.srt.managers.io_struct import (
    BatchOutput,
    SchedulerError,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReqInput,
)

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long rank 0 waits for a message when there is nothing to do
TRANSFER_POLL_S = 0.002  # the same while host transfers are in flight, or while work is blocked


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{' ' + prefix if prefix else ''}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)


class SchedulerLoop:
    def __init__(self, scheduler, in_queue=None, out_queue=None):
        self.scheduler = scheduler
        self.rank = scheduler.runner.config.rank
        self.world_size = scheduler.runner.config.world_size
        self.in_queue = in_queue
        self.out_queue = out_queue
        self.parent_pid = os.getppid()
        self._rng = random.Random()

    def _drain(self, timeout: float) -> list:
        msgs = []
        try:
            msgs.append(self.in_queue.get(timeout=timeout) if timeout > 0 else self.in_queue.get_nowait())
            while True:
                msgs.append(self.in_queue.get_nowait())
        except queue.Empty:
            pass
        for m in msgs:
            if isinstance(m, TokenizedGenerateReqInput) and m.seed is None:
                m.seed = self._rng.getrandbits(62)
        return msgs

    def recv(self, timeout: float) -> list:
        msgs = self._drain(timeout) if self.rank == 0 else []
        if self.world_size > 1:
            import torch.distributed as dist

            from sglang.srt.distributed import get_world_group

            box = [msgs]
            dist.broadcast_object_list(box, src=0, group=get_world_group().cpu_group)
            msgs = box[0]
        return msgs

    def run(self) -> None:
        sched = self.scheduler
        progressed = True
        while True:
            has_work = sched.has_work()
            in_flight = not has_work and sched.transfers_in_flight()
            msgs = self.recv(poll_timeout(has_work, progressed, in_flight))
            if any(isinstance(m, ShutdownReq) for m in msgs):
                logger.info("scheduler shutting down")
                return
            replies = sched.handle_messages(msgs)
            batches = _batches_run(sched)
            outputs = sched.step()
            progressed = _batches_run(sched) != batches
            sched.on_idle()
            if self.rank == 0 and (outputs or replies):
                self.out_queue.put([BatchOutput(outputs)] + replies if outputs else replies)
            if os.getppid() != self.parent_pid:
                logger.error("the server process is gone; scheduler exiting")
                return


def poll_timeout(has_work: bool, progressed: bool, transfers_in_flight: bool) -> float:
    """How long rank 0 waits for messages before the next step (seconds; a message ends the wait).

    Work that made progress last step: no wait. Work whose last step ran no batch is blocked
    (on device memory held by prefixes locked for host writes, on an L3 prefetch): a short
    sleep, never a spin. A spinning loop re-matches the waiting requests in Python and holds
    the GIL against the transfer lane and storage threads it is waiting for (issue 9's slow
    passes). No work: a short wait while transfers are in flight, else the idle poll.
    """
    if has_work:
        return 0.0 if progressed else TRANSFER_POLL_S
    return TRANSFER_POLL_S if transfers_in_flight else IDLE_POLL_S


def _batches_run(sched) -> int:
    counters = sched.stats.counters
    return counters.num_prefill_batches + counters.num_decode_batches


def run_scheduler_process(server_args, tp_rank: int, dist_port: int | None, in_queue, out_queue, status_queue,
                          disagg_factory=None, kv_events_factory=None):
    """Process entry: build the Scheduler (``disagg_factory``, ``kv_events_factory``: see
    ``Scheduler``), report ready (or the error), then loop. ``tp_rank`` is the global rank
    (``pp_rank * tp_size + tp_rank``; the TP rank itself without pipeline parallelism)."""
    pp_size, cp_size = getattr(server_args, "pp_size", 1), getattr(server_args, "attn_cp_size", 1)
    tag = (f"TP{tp_rank % server_args.tp_size}" + (f" PP{tp_rank // server_args.tp_size}" if pp_size > 1 else "")
           + (f" CP{tp_rank // server_args.tp_size}" if cp_size > 1 else ""))
    configure_logging(server_args.log_level, tag)
    init = f"tcp://127.0.0.1:{dist_port}" if server_args.tp_size * pp_size * cp_size > 1 else None
    try:
        from sglang.srt.managers.scheduler import Scheduler

        scheduler = Scheduler(server_args, tp_rank, init, disagg_factory, kv_events_factory)
    except Exception as exc:  # reported to the launcher, which prints it and exits
        logger.debug("start-up failed", exc_info=True)
        status_queue.put(SchedulerError(tp_rank, f"{type(exc).__name__}: {exc}"))
        return
    # Start-up objects (weights, pools, tokenizer) never die: keep them out of every future
    # collection, whose full passes over them cost ~70 ms each.
    gc.freeze()
    status_queue.put(SchedulerReady(tp_rank, scheduler.server_info()))
    try:
        SchedulerLoop(scheduler, in_queue, out_queue).run()
    except Exception as exc:
        logger.error("scheduler failed:\n%s", traceback.format_exc())
        if out_queue is not None:
            out_queue.put([SchedulerError(tp_rank, f"{type(exc).__name__}: {exc}")])
            out_queue.close()
            out_queue.join_thread()  # flush the report before the hard exit
        os._exit(1)
    scheduler.shutdown()
