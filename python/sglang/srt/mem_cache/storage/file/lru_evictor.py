"""Capacity accounting with least-recently-used eviction for the file backend.

The evictor only keeps the books (name -> bytes, in use order); the backend deletes the files
it names. It knows the files this process saw (at startup scan, write or read), so several
processes sharing one directory each keep within their own view of the cap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class LRUEvictor:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, name: str, nbytes: int) -> list[str] | None:
        """Account ``nbytes`` for ``name`` (replacing its old size) and return the names to
        evict to stay within capacity, oldest first; None when ``nbytes`` alone exceeds it."""
        if nbytes > self.capacity_bytes:
            return None
        with self._lock:
            return self._reserve_locked(name, nbytes)

    def reserve_many(self, names: list[str], sizes: list[int], evict) -> list[bool]:
        """:meth:`reserve` each name in order under one lock; ``evict(victims)`` is called once
        with every name evicted to make room. Per name: whether it is still reserved (False when
        it alone exceeds the capacity, or a later name of the batch evicted it again)."""
        fits, victims, mine = [], [], {}
        with self._lock:
            for name, nbytes in zip(names, sizes):
                if nbytes > self.capacity_bytes:
                    fits.append(False)
                    continue
                for victim in self._reserve_locked(name, nbytes):
                    if victim in mine:  # reserved earlier in this batch: not written at all
                        fits[mine.pop(victim)] = False
                    else:
                        victims.append(victim)
                mine[name] = len(fits)
                fits.append(True)
        if victims:
            evict(victims)
        return fits

    def _reserve_locked(self, name: str, nbytes: int) -> list[str]:
        """Book ``nbytes`` for ``name``; the oldest entries evicted to make room (the caller
        holds the lock and checked that ``nbytes`` fits the capacity)."""
        entries, victims = self._entries, []
        self.used_bytes -= entries.pop(name, 0)
        while self.used_bytes + nbytes > self.capacity_bytes and entries:
            victim, size = entries.popitem(last=False)
            self.used_bytes -= size
            victims.append(victim)
        entries[name] = nbytes
        self.used_bytes += nbytes
        return victims

    def touch(self, name: str) -> None:
        """Mark ``name`` as just used (no-op when unknown)."""
        with self._lock:
            if name in self._entries:
                self._entries.move_to_end(name)

    def touch_many(self, names: list[str]) -> None:
        """:meth:`touch` each of ``names``, in order, under one lock."""
        if not names:
            return
        with self._lock:
            entries = self._entries
            for name in names:
                if name in entries:
                    entries.move_to_end(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self.used_bytes -= self._entries.pop(name, 0)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0
