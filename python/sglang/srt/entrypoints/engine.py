"""Engine: starts one scheduler process per rank (tp_size x pp_size) and owns the tokenizer manager.

``Engine(server_args)`` returns once every rank reported ready, or raises
``EngineStartupError`` with the first rank's error (a bad model directory, a pool that does not
fit, an impossible HiCache combination) after stopping the others. A watcher thread notices a
scheduler process that dies later and fails every pending request (the server then answers
503). ``shutdown`` stops the processes; scheduler processes also exit on their own when this
process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import queue
import socket
import threading
import time

from sglang.srt.managers.io_struct import SchedulerError, SchedulerReady, ShutdownReq
from sglang.srt.disaggregation.kv_events import EventPublisherFactory
from sglang.srt.disaggregation.scheduler_glue import build_disaggregation
from sglang.srt.managers.scheduler_process import run_scheduler_process
from sglang.srt.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """A scheduler rank could not start; the message is that rank's error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, server_args, startup_timeout_s: float = 600.0):
        self.args = server_args
        ctx = mp.get_context("spawn")
        self.in_queue, self.out_queue = ctx.Queue(), ctx.Queue()
        status = ctx.Queue()
        pp_size = getattr(server_args, "pp_size", 1)
        cp_size = getattr(server_args, "attn_cp_size", 1)
        world = server_args.tp_size * pp_size * cp_size  # global rank: (pp_rank | attn_cp_rank) * tp_size + tp_rank
        dist_port = free_port() if world > 1 else None
        self.procs = []
        self._stopping = False
        for rank in range(world):
            first = rank == 0
            proc = ctx.Process(
                target=run_scheduler_process,
                args=(server_args, rank, dist_port, self.in_queue if first else None,
                      self.out_queue if first else None, status, build_disaggregation, EventPublisherFactory.create),
                name=f"sglang-scheduler-tp{rank % server_args.tp_size}"
                     + (f"-pp{rank // server_args.tp_size}" if pp_size > 1 else "")
                     + (f"-cp{rank // server_args.tp_size}" if cp_size > 1 else ""),
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
        try:
            self.info = self._wait_ready(status, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer_manager = TokenizerManager(server_args, self.info, self.in_queue, self.out_queue)
        logger.info("engine ready: %s", self.info)

    def _wait_ready(self, status, timeout_s: float) -> dict:
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.procs):
            try:
                msg = status.get(timeout=0.2)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    rank, code = dead[0]
                    raise EngineStartupError(f"scheduler rank {rank} exited with code {code} during start-up")
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"scheduler not ready after {timeout_s:.0f} s")
                continue
            if isinstance(msg, SchedulerError):
                raise EngineStartupError(msg.message)
            if isinstance(msg, SchedulerReady):
                ready[msg.tp_rank] = msg.info
        return ready[0]

    def start(self, loop) -> None:
        """Start delivering outputs on ``loop`` and watching the scheduler processes."""
        self.tokenizer_manager.start(loop)
        threading.Thread(target=self._watch, name="scheduler-watch", daemon=True).start()

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._stopping:
            return
        exited = [(p.name, p.exitcode) for p in self.procs if p.exitcode is not None]
        self.tokenizer_manager.mark_dead(f"scheduler process exited: {exited}")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the schedulers to stop, then terminate whatever is still running."""
        self._stopping = True
        if all(p.is_alive() for p in self.procs):
            self.in_queue.put(ShutdownReq())
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(2)
        if hasattr(self, "tokenizer_manager"):
            self.tokenizer_manager.stop()
