"""AddrLookups: bootstrap lookups off the scheduler thread, per address, so a bad host costs
only the requests that name it.

A lookup is blocking HTTP: against a host that drops packets each attempt waits out the
client's timeout. Lookups therefore run on a pool of worker threads, at most ONE in flight per
bootstrap address (every room waiting on that address shares it), and an address is tried again
no sooner than ``retry_s`` after its last attempt ended. A few requests naming a black-hole host
hold one worker between them; lookups of other addresses run on the other workers. (More
distinct unresponsive addresses than workers at once would queue behind each other: the
allow-list bounds the addresses a request may name.)
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

logger = logging.getLogger(__name__)


class AddrLookups:
    """Runs ``resolve(addr)`` for ``request(addr)``; calls ``on_done(addr, result, exc)`` on the
    worker thread when it ends (exactly one of result / exc is meaningful)."""

    def __init__(self, resolve: Callable, on_done: Callable, max_workers: int = 32, retry_s: float = 0.05,
                 name: str = "pd-lookup"):
        self._resolve, self._on_done, self.retry_s = resolve, on_done, retry_s
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, Future] = {}
        self._next_try: dict[Hashable, float] = {}

    def request(self, addr: Hashable) -> bool:
        """Start a lookup of ``addr`` unless one is in flight or its last ended under ``retry_s``
        ago; True when one started. Never blocks on the lookup."""
        with self._lock:
            if addr in self._inflight or time.monotonic() < self._next_try.get(addr, 0.0):
                return False
            try:
                self._inflight[addr] = self._pool.submit(self._run, addr)
            except RuntimeError:  # shut down
                return False
            return True

    def in_flight(self, addr: Hashable) -> bool:
        with self._lock:
            return addr in self._inflight

    def _run(self, addr: Hashable) -> None:
        result, exc = None, None
        try:
            result = self._resolve(addr)
        except Exception as e:  # handed to on_done, which decides
            exc = e
        with self._lock:
            self._inflight.pop(addr, None)
            now = time.monotonic()
            if len(self._next_try) > 1024:  # forget addresses whose pause is over
                self._next_try = {a: t for a, t in self._next_try.items() if t > now}
            self._next_try[addr] = now + self.retry_s
        try:
            self._on_done(addr, result, exc)
        except Exception:
            logger.exception("bootstrap lookup callback for %s failed", addr)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
