"""TierCounters: thread-safe integer counters of one cache tier (e.g. the L2 pages and bytes
moved by HiCacheController's lanes)."""

from __future__ import annotations

import threading


class TierCounters:
    """Thread-safe integer counters of one tier."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def add_pair(self, names: tuple[str, str], first: int, second: int) -> None:
        """``add`` of two counters, without building keyword arguments (once per transfer)."""
        with self._lock:
            counts = self._counts
            counts[names[0]] += first
            counts[names[1]] += second

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
