"""Transfer lanes: where L1<->L2 copies run, in order, off the scheduler's critical path.

A lane is a CUDA stream on a GPU and a worker thread elsewhere. The controller's code is the
same for both: it submits a job (a callable that copies and records events) and later polls or
waits on the events. Events differ only in what "record" means: on a stream it enqueues a
marker; in the worker thread it marks the point reached, since the thread copies synchronously.

A job that raises fails every event it was given that it has not recorded yet, so a waiter
never hangs on a failed copy: ``synchronize``/``wait`` raise ``HiCacheTransferError`` and
``query`` returns True with ``error`` set.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Worker lanes still open, closed at interpreter exit: a daemon thread that the interpreter
# freezes in the middle of a copy inside torch's C++ code aborts the whole process ("terminate
# called without an active exception"), so each lane finishes its queue first.
_OPEN_LANES: "weakref.WeakSet[ThreadLane]" = weakref.WeakSet()
EXIT_JOIN_TIMEOUT_S = 10


@atexit.register
def _close_open_lanes() -> None:
    for lane in list(_OPEN_LANES):
        lane.close(timeout=EXIT_JOIN_TIMEOUT_S)


class HiCacheTransferError(RuntimeError):
    """A copy between tiers failed (on this rank or, after TP agreement, on some rank)."""


class CpuEvent:
    """A lane event for the worker-thread lane. Starts recorded (waiting on it is a no-op)."""

    def __init__(self, armed: bool = False):
        self._done = threading.Event()
        self.error: BaseException | None = None
        if not armed:
            self._done.set()

    def arm(self) -> None:
        """Make the event pending again before the job that records it is submitted."""
        self.error = None
        self._done.clear()

    def record(self) -> None:
        self._done.set()

    @property
    def recorded(self) -> bool:
        return self._done.is_set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"transfer event not done after {timeout} s")
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error

    def wait(self) -> None:
        """Block the calling (compute) thread until recorded."""
        self.synchronize()


class CudaEvent:
    """A lane event on a CUDA stream; ``wait`` makes the current stream wait without blocking."""

    def __init__(self, armed: bool = False):
        self._event = torch.cuda.Event()
        self.error: BaseException | None = None
        # torch.cuda.Event.query() is true before any record, so recording is tracked here
        self.recorded = not armed

    def arm(self) -> None:
        self.error = None
        self.recorded = False

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream())
        self.recorded = True

    def fail(self, exc: BaseException) -> None:
        self.error = exc

    def query(self) -> bool:
        return self.error is not None or self._event.query()

    def synchronize(self, timeout: float | None = None) -> None:
        self._event.synchronize()
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error

    def wait(self) -> None:
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error
        torch.cuda.current_stream().wait_event(self._event)


Job = Callable[[], None]


def _fail_pending(events: Sequence, exc: BaseException) -> None:
    for ev in events:
        if ev.error is None and not _recorded(ev):
            ev.fail(exc)


def _recorded(ev) -> bool:
    return ev.recorded


class ThreadLane:
    """Runs jobs one at a time, in submission order, on a daemon worker thread."""

    event_cls = CpuEvent

    def __init__(self, name: str):
        self.name = name
        self.error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _OPEN_LANES.add(self)

    def new_event(self, armed: bool = True) -> CpuEvent:
        return CpuEvent(armed)

    def submit(self, job: Job, events: Sequence[CpuEvent]) -> None:
        """Queue ``job``; ``events`` are the ones it records (failed if it raises)."""
        if not self._thread.is_alive():
            raise RuntimeError(f"transfer lane {self.name} is closed")
        self._jobs.put((job, events))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, events = item
            try:
                job()
            except BaseException as exc:  # surfaced through the events and self.error
                logger.error("transfer lane %s: job failed: %r", self.name, exc)
                self.error = exc
                _fail_pending(events, exc)

    def synchronize(self) -> None:
        """Block until every job submitted so far has run."""
        done = CpuEvent(armed=True)
        self.submit(done.record, [done])
        done.synchronize()

    def close(self, timeout: float = 30) -> None:
        """Run the jobs queued so far, then stop the worker (waits at most ``timeout`` s)."""
        _OPEN_LANES.discard(self)
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=timeout)


class StreamLane:
    """Runs jobs on a dedicated CUDA stream, after the work already queued on the current one."""

    event_cls = CudaEvent

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream(device=device)

    def new_event(self, armed: bool = True) -> CudaEvent:
        return CudaEvent(armed)

    def submit(self, job: Job, events: Sequence[CudaEvent]) -> None:
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(start)
            try:
                job()
            except Exception as exc:
                logger.error("transfer lane %s: job failed: %r", self.name, exc)
                self.error = exc
                _fail_pending(events, exc)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()


def make_lane(name: str, device: torch.device | str) -> ThreadLane | StreamLane:
    """A stream lane for a CUDA device, a worker-thread lane otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return StreamLane(name, device)
    return ThreadLane(name)
