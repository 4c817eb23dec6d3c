"""Device<->host copy figures under upstream's HiCache metric names, counted when a copy is done.

The controller registers every copy it submits (``L2TransferMetrics.submitted``): its finish
event, its ``CopyTiming``, its slots per pool and its bytes. ``collect`` (run at each new copy and
at every /metrics scrape) counts the leading copies whose finish event is done:
copies run in submission order on their lane, so the first one not done ends the walk. A copy
that failed is dropped uncounted. Write-backs without an ack (``write(ack=False)``) are counted
the same way, so backups of every write policy are covered, as upstream's are.

``CopyTiming`` measures where the copy runs: the wall time of the copy loop on a worker-thread
lane (the copies are synchronous there), the GPU span between two timing events on a CUDA
stream lane. It is stopped before the job records its finish event, so a done event means a
finished timing. A batch of deferred writes merged into one job is timed once, through the
first write's timing (upstream observes one duration per merged write op).

Units: slots (tokens; a Mamba slot is one state) per pool name (``PoolName`` values), bytes of
every pool a binding moves, seconds. No prometheus import: this runs in the scheduler process.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

__all__ = ["BACKUP_DURATION_BUCKETS_S", "LOAD_BACK_DURATION_BUCKETS_S", "CopyTiming", "DurationHistogram",
           "L2TransferMetrics"]

# upstream's default buckets (RadixCacheMetricsCollector): backups may block for seconds under
# write_back, load-backs are short
BACKUP_DURATION_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
LOAD_BACK_DURATION_BUCKETS_S = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03,
                                0.04, 0.05, 0.1, 0.2, 0.5, 1.0)
BACKUP, LOAD_BACK = "backup", "load_back"


class CopyTiming:
    """Start and stop of one lane job's copies; ``cuda``: the job runs on a CUDA stream lane.
    ``start``/``stop`` are called by the job, on the lane."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self._start = self._stop = None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()  # the job's current stream: the lane's
        return event

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        self._stop = self._mark()

    @property
    def timed(self) -> bool:
        return self._start is not None and self._stop is not None

    def seconds(self) -> float | None:
        """Start to stop, once the copy's finish event is done; None when the job did not time
        (it failed, or it ran merged into another write's job)."""
        if not self.timed:
            return None
        if self.cuda:
            return self._start.elapsed_time(self._stop) / 1000.0
        return self._stop - self._start


class DurationHistogram:
    """Observation counts per bucket (``le`` upper bounds, seconds; the last count is +Inf)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict:
        """``buckets`` (bounds), ``counts`` (per bucket, not cumulative, +Inf last), ``sum``."""
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


@dataclass
class _Copy:
    finish_event: object
    timing: CopyTiming
    slots_by_pool: dict[str, int]
    num_bytes: int


class _Direction:
    def __init__(self, buckets: tuple[float, ...]):
        self.pending: deque[_Copy] = deque()
        self.tokens_by_pool: dict[str, int] = {}
        self.bytes = 0
        self.duration = DurationHistogram(buckets)

    def collect(self) -> None:
        while self.pending and self.pending[0].finish_event.query():
            copy = self.pending.popleft()
            if copy.finish_event.error is not None:
                continue  # failed: nothing moved that a reader may use
            for pool, n in copy.slots_by_pool.items():
                self.tokens_by_pool[pool] = self.tokens_by_pool.get(pool, 0) + n
            self.bytes += copy.num_bytes
            seconds = copy.timing.seconds()
            if seconds is not None:
                self.duration.observe(seconds)

    def snapshot(self) -> dict:
        return {"tokens_by_pool": dict(self.tokens_by_pool), "bytes": self.bytes,
                "duration_seconds": self.duration.snapshot()}


class L2TransferMetrics:
    """Done device->host (``backup``) and host->device (``load_back``) copies of one controller."""

    def __init__(self):
        self._lock = threading.Lock()
        self._directions = {BACKUP: _Direction(BACKUP_DURATION_BUCKETS_S),
                            LOAD_BACK: _Direction(LOAD_BACK_DURATION_BUCKETS_S)}

    def submitted(self, direction: str, finish_event, timing: CopyTiming, slots_by_pool: dict[str, int],
                  num_bytes: int) -> None:
        """A copy was handed to its lane (in lane order); counted once ``finish_event`` is done.
        Copies done by now are counted first, so only copies in flight wait here."""
        with self._lock:
            d = self._directions[direction]
            d.collect()
            d.pending.append(_Copy(finish_event, timing, slots_by_pool, num_bytes))

    def collect(self) -> None:
        """Count the copies done so far (leading ones of each direction)."""
        with self._lock:
            for d in self._directions.values():
                d.collect()

    def snapshot(self) -> dict:
        """{direction: {tokens_by_pool, bytes, duration_seconds}} after a ``collect``."""
        with self._lock:
            for d in self._directions.values():
                d.collect()
            return {name: d.snapshot() for name, d in self._directions.items()}
