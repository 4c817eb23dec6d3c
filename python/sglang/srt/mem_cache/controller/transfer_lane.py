"""Transfer lanes: where L1<->L2 copies run, in order, off the scheduler's critical path.

A lane is a CUDA stream on a GPU and a worker thread elsewhere. The controller's code is the
same for both: it submits a job (a callable that copies and records events) and later polls or
waits on the events. Events differ only in what "record" means: on a stream it enqueues a
marker; in the worker thread it marks the point reached, since the thread copies synchronously.

A job that raises fails every event it was given that it has not recorded yet, so a waiter
never hangs on a failed copy: ``synchronize``/``wait`` raise ``HiCacheTransferError`` and
``query`` returns True with ``error`` set.

A worker lane made with ``run_on_wait`` (the L1<->L2 lanes, see ``make_lane``) lets a thread
that would block on it run the jobs not yet started itself, in order, instead of waking the
worker and waiting for the hand-off: ``ThreadLane.synchronize`` and ``CpuEvent.synchronize``
of its events (not ``wait``, the per-layer wait of a forward, which must not take a whole load
job). Jobs still run one at a time in submission order, whichever thread runs them. On a busy
host a wake-up of the worker and the GIL hand-off back cost far more than a short copy (issue
9), and the waiting thread had nothing else to do.

For the same reason such a lane runs a job submitted with ``short=True`` in the submitting
thread when the lane is idle and its recent short jobs took less than ``INLINE_MAX_S`` (about
one thread hand-off): waking the worker for a job of a few microseconds cost the scheduler
60-80 us a step on a 2-core host. A job that turns out longer sends the next ones back to the
worker at once. Only the L1<->L2 copy jobs are marked short (they never block); a stream
lane runs every job in the submitting thread anyway (the copies themselves are asynchronous).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Worker lanes still open, closed at interpreter exit: a daemon thread that the interpreter
# freezes in the middle of a copy inside torch's C++ code aborts the whole process ("terminate
# called without an active exception"), so each lane finishes its queue first.
_OPEN_LANES: "weakref.WeakSet[ThreadLane]" = weakref.WeakSet()
EXIT_JOIN_TIMEOUT_S = 10
# A short job (see the module docstring) runs in the submitting thread while recent ones took
# less than this: about what waking the worker and taking the GIL back costs on a busy host.
INLINE_MAX_S = 50e-6


@atexit.register
def _close_open_lanes() -> None:
    for lane in list(_OPEN_LANES):
        lane.close(timeout=EXIT_JOIN_TIMEOUT_S)


class HiCacheTransferError(RuntimeError):
    """A copy between tiers failed (on this rank or, after TP agreement, on some rank)."""


class CpuEvent:
    """A lane event for the worker-thread lane. Starts recorded (waiting on it is a no-op).

    A plain lock is the gate: held while the event is pending, released by ``record`` or
    ``fail``. Arming, recording and polling are then single C calls (a ``threading.Event`` runs
    a Python condition variable for each, several times a step). Only the job that records an
    event records or fails it, and it is re-armed only once recorded, with no waiter left.
    """

    def __init__(self, armed: bool = False, lane: ThreadLane | None = None):
        self._gate = threading.Lock()
        self._set = True
        self.error: BaseException | None = None
        self._lane = lane  # a run_on_wait lane whose jobs record this event
        if armed:
            self.arm()

    def arm(self) -> None:
        """Make the event pending again before the job that records it is submitted."""
        self.error = None
        if self._set:
            self._gate.acquire()
            self._set = False

    def _open(self) -> None:
        if not self._set:
            self._set = True
            self._gate.release()

    def record(self) -> None:
        self._open()

    @property
    def recorded(self) -> bool:
        return self._set

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self._open()

    def query(self) -> bool:
        return self._set

    def synchronize(self, timeout: float | None = None) -> None:
        if self._lane is not None and not self._set:
            self._lane.run_pending_until(self)
        self._wait(timeout)

    def _wait(self, timeout: float | None) -> None:
        if not self._set:
            if not self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise TimeoutError(f"transfer event not done after {timeout} s")
            self._gate.release()
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error

    def wait(self) -> None:
        """Block the calling (compute) thread until recorded (never runs lane jobs itself)."""
        self._wait(None)


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
        """Done: failed, or recorded and reached by its stream. An armed event whose job was not
        submitted yet (a deferred write) is not done, though torch's query() says so."""
        return self.error is not None or (self.recorded and self._event.query())

    def synchronize(self, timeout: float | None = None) -> None:
        if not self.recorded and self.error is None:
            raise RuntimeError("transfer event armed but its job was never submitted (start the deferred "
                               "copies first): waiting on it would return before the copy ran")
        self._event.synchronize()
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error

    def wait(self) -> None:
        if self.error is not None:
            raise HiCacheTransferError(f"transfer failed: {self.error!r}") from self.error
        if not self.recorded:  # a stream waiting on an unrecorded event does not wait at all
            raise RuntimeError("transfer event armed but its job was never submitted: the compute stream "
                               "would not wait for the copy")
        torch.cuda.current_stream().wait_event(self._event)


Job = Callable[[], None]


def _fail_pending(events: Sequence, exc: BaseException) -> None:
    for ev in events:
        if ev.error is None and not _recorded(ev):
            ev.fail(exc)


def _recorded(ev) -> bool:
    return ev.recorded


class ThreadLane:
    """Runs jobs one at a time, in submission order, on a daemon worker thread.

    ``run_on_wait``: a thread blocking in ``synchronize`` (or in ``synchronize`` of an event
    from ``new_event``) runs the jobs the worker has not started yet itself (see the module
    docstring). Off for lanes whose jobs may block for long (storage I/O: a bounded flush must
    stay bounded), so ``ThreadLane(name)`` keeps every job on the worker.
    """

    event_cls = CpuEvent

    def __init__(self, name: str, run_on_wait: bool = False):
        self.name = name
        self.run_on_wait = run_on_wait
        self.error: BaseException | None = None
        # Recent run time of short jobs (s): unknown (inf) until one has run; it jumps up with a
        # longer job and decays with shorter ones. num_inline counts short jobs run in submit.
        self._short_job_s = float("inf")
        self.num_inline = 0
        self._running = False  # a job is running (set and cleared under _run_lock)
        # Jobs wait in _pending (deque appends/pops are atomic); every pop and run happens under
        # _run_lock, so jobs run one at a time and in order whichever thread takes them. _wake
        # gets one token per submit; a token whose job a waiter already ran finds nothing.
        self._pending: deque = deque()
        self._run_lock = threading.Lock()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _OPEN_LANES.add(self)

    def new_event(self, armed: bool = True) -> CpuEvent:
        return CpuEvent(armed, self if self.run_on_wait else None)

    def submit(self, job: Job, events: Sequence[CpuEvent], short: bool = False) -> None:
        """Queue ``job``; ``events`` are the ones it records (failed if it raises). ``short``: a
        job that never blocks (a copy), which a ``run_on_wait`` lane may run right here (see the
        module docstring); either way it runs after every job submitted before it."""
        if self._closed:  # the worker only stops through close()
            raise RuntimeError(f"transfer lane {self.name} is closed")
        # With nothing queued or running, whoever holds the run lock is about to let it go (a waiter
        # that ran the queue, or the worker finding it empty), so waiting for it is short; a stale
        # holder would otherwise send a short job to the worker, and its ack a step later.
        if (short and self.run_on_wait and self._short_job_s < INLINE_MAX_S and not self._pending
                and not self._running and self._run_lock.acquire()):
            try:
                if not self._pending:  # nothing queued or running ahead of it: order is kept
                    self.num_inline += 1
                    self._run_job(job, events, short)
                    return
            finally:
                self._run_lock.release()
        self._pending.append((job, events, short))
        self._wake.put(True)

    def _run_next(self) -> bool:
        """Run the oldest pending job (the caller holds ``_run_lock``); False when none."""
        try:
            job, events, short = self._pending.popleft()
        except IndexError:
            return False
        self._running = True
        try:
            self._run_job(job, events, short)
        finally:
            self._running = False
        return True

    def _run_job(self, job: Job, events: Sequence[CpuEvent], short: bool) -> None:
        start = time.perf_counter()
        try:
            job()
        except BaseException as exc:  # surfaced through the events and self.error
            logger.error("transfer lane %s: job failed: %r", self.name, exc)
            self.error = exc
            _fail_pending(events, exc)
        if short:
            took = time.perf_counter() - start
            recent = self._short_job_s
            self._short_job_s = took if took > recent or recent == float("inf") else 0.75 * recent + 0.25 * took

    def _run(self) -> None:
        while self._wake.get() is not None:
            if not self._pending:  # its job already ran in a waiter's thread: leave the lock alone
                continue
            with self._run_lock:
                self._run_next()

    def run_pending_until(self, event: CpuEvent) -> None:
        """Run jobs not started yet in the calling thread until ``event`` is recorded or none is
        left. Returns at once when the worker is running a job (the event may be recorded part
        way through it, e.g. a layer of a load): the caller then waits on the event."""
        if not self._run_lock.acquire(blocking=False):
            return
        try:
            while not event.recorded and self._run_next():
                pass
        finally:
            self._run_lock.release()

    def synchronize(self) -> None:
        """Block until every job submitted so far has run."""
        if self.run_on_wait:
            with self._run_lock:  # the worker's current job ends first; then the rest, in order
                while self._run_next():
                    pass
            return
        done = CpuEvent(armed=True)
        self.submit(done.record, [done])
        done.synchronize()

    def close(self, timeout: float = 30) -> None:
        """Run the jobs queued so far, then stop the worker (waits at most ``timeout`` s)."""
        _OPEN_LANES.discard(self)
        self._closed = True
        if self._thread.is_alive():
            self._wake.put(None)
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

    def submit(self, job: Job, events: Sequence[CudaEvent], short: bool = False) -> None:
        """Enqueue ``job``'s copies on the stream now (``short`` changes nothing here)."""
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
    """A stream lane for a CUDA device, a worker-thread lane otherwise (``run_on_wait``: its
    jobs are L1<->L2 copies, short and never blocking)."""
    device = torch.device(device)
    if device.type == "cuda":
        return StreamLane(name, device)
    return ThreadLane(name, run_on_wait=True)
