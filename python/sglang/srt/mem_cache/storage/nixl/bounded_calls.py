"""Bounding NIXL calls that wait on a remote endpoint (the OBJ plugin's S3 server).

The OBJ plugin answers a HeadObject or a transfer only after the S3 SDK has given up retrying,
about 25 s per object against a dead endpoint, one object after another. NIXL cannot cancel
such a call, so it runs on a worker thread and the caller waits at most ``transfer_timeout_s``
for it. A call still running past its deadline is *overdue*: while one is, the endpoint counts
as unavailable and every later call fails at once (a miss for the caller) instead of queueing
behind it. That also keeps a late transfer from writing into a staging buffer that a newer
transfer already uses. Once every overdue call has returned (the SDK gave up, or the endpoint
answered again), calls go through again: the backend recovers without a restart.

Local plugins (POSIX) run their calls inline: there is nothing remote to wait for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from sglang.srt.mem_cache.hicache_storage import StorageBackendError

logger = logging.getLogger(__name__)


class StorageUnavailable(StorageBackendError):
    """The endpoint did not answer within ``transfer_timeout_s`` (or an earlier call is still
    outstanding past its deadline). Callers treat it as a miss and do not retry."""

    quiet = True


class BoundedCalls:
    def __init__(self, timeout_s: float, remote: bool):
        self.timeout_s = timeout_s
        self.remote = remote
        self._overdue: list[Callable[[], bool]] = []  # each: "has it finished?" (cleans up when so)
        self._lock = threading.Lock()
        self._unavailable_since: float | None = None

    def check(self, what: str) -> None:
        """Raise StorageUnavailable while a call past its deadline is still outstanding."""
        with self._lock:
            self._overdue = [done for done in self._overdue if not _finished(done)]
            if self._overdue:
                raise StorageUnavailable(f"NIXL {what} skipped: an earlier call is still outstanding past "
                                         f"transfer_timeout_s={self.timeout_s}s (endpoint unavailable)")
            if self._unavailable_since is not None:
                logger.warning("NIXL endpoint answers again after %.1fs; storage calls resume",
                               time.monotonic() - self._unavailable_since)
                self._unavailable_since = None

    def run(self, what: str, deadline: float, fn, *args):
        """``fn(*args)``, waiting until ``deadline`` (time.monotonic()) at most for a remote call."""
        self.check(what)
        if not self.remote:
            return fn(*args)
        call = _DaemonCall(fn, args, what)
        if not call.wait(deadline - time.monotonic()):
            self.overdue(what, call.done.is_set)
            raise StorageUnavailable(f"NIXL {what} did not finish within transfer_timeout_s={self.timeout_s}s")
        return call.result()

    def overdue(self, what: str, finished: Callable[[], bool]) -> None:
        """Record a call that missed its deadline; ``finished()`` says (and cleans up) when it ends."""
        with self._lock:
            self._overdue.append(finished)
            if self._unavailable_since is None:
                self._unavailable_since = time.monotonic()
                logger.warning("NIXL %s did not finish within transfer_timeout_s=%ss: endpoint treated as "
                               "unavailable (storage calls miss) until it returns", what, self.timeout_s)

    @property
    def unavailable(self) -> bool:
        """Whether a call past its deadline is still outstanding (calls would fail at once)."""
        try:
            self.check("probe")
        except StorageUnavailable:
            return True
        return False


class _DaemonCall:
    """``fn(*args)`` on a daemon thread: an overdue call never holds up the process's exit (a
    pool's workers would be joined at exit, hours later against a dead endpoint)."""

    def __init__(self, fn, args, what: str):
        self.done = threading.Event()
        self._value, self._error = None, None
        self._fn, self._args = fn, args
        threading.Thread(target=self._run, name=f"nixl-{what}", daemon=True).start()

    def _run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self._error = exc
        finally:
            self.done.set()

    def wait(self, timeout_s: float) -> bool:
        return self.done.wait(max(0.0, timeout_s))

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


def _finished(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:  # noqa: BLE001 - a probe that fails counts as finished; the call is gone
        logger.debug("probing an overdue NIXL call failed", exc_info=True)
        return True
