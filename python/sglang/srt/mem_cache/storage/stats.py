"""Per-backend counters, safe to update from the prefetch and backup threads."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class StorageCounters:
    pages_hit: int = 0  # pages read and verified
    pages_missed: int = 0  # pages asked for and not loaded (absent, corrupt or failed)
    pages_written: int = 0
    pages_skipped: int = 0  # writes skipped on purpose (replicated pool on TP rank != 0)
    bytes_read: int = 0  # payload bytes moved into host memory
    bytes_written: int = 0  # payload bytes stored
    failures: int = 0  # backend faults (I/O errors, transfer errors, exceptions)
    corruptions: int = 0  # objects that failed their integrity check and were removed
    timeouts: int = 0  # calls that missed because the endpoint did not answer in time (also failures)
    groups_evicted: int = 0  # page groups (every object of a page, all pools) removed for capacity
    bytes_evicted: int = 0  # stored bytes (payload and trailers) those groups held


class StorageStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._counters = StorageCounters()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._counters)
