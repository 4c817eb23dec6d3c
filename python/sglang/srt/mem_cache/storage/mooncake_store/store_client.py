"""The Mooncake store client behind the backend: setup, registered memory, batched calls and
the meaning of their return codes.

Mooncake answers every key of a batch with an int: a byte count or 0 on success, a negative
``ErrorCode`` otherwise. :func:`classify` maps each onto an :class:`Outcome`, so the backend
never compares raw codes. Store keys are the backend's object names under :data:`KEY_PREFIX`,
which marks this fork's pages in a store shared with other users (and lets ``clear`` find them).

Availability. Measured with the 0.3.13 wheel: while the master is gone, a call returns RPC_FAIL
at once or after Mooncake's own reconnect attempt (about 4.5 s); a peer that stopped answering
holds a transfer for about three times Mooncake's TCP progress/status timeouts (30 s each by
default), which :func:`bound_tcp_timeouts` derives from ``transfer_timeout_s``. A call never
returns while Mooncake may still write host memory, so a miss leaves no late write behind. After
an RPC failure the master counts as unavailable: every call misses at once
(:class:`MooncakeUnavailable`) until the client's heartbeat has found it back (Mooncake remounts
the client's segment by itself), see :meth:`MooncakeClient.check_available`: recovery needs no
restart.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from itertools import accumulate

from sglang.srt.mem_cache.hicache_storage import StorageBackendError
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_config import DEFAULT_LOCAL_BUFFER_SIZE, MooncakeOptions
from sglang.srt.utils.mooncake_env import TCP_TIMEOUT_ENVS, bound_tcp_timeouts  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

KEY_PREFIX = "sglang-hicache/"
PROBE_AFTER_S = 5.0  # after an RPC failure the heartbeat never confirmed: when to try again


class Outcome(Enum):
    OK = "ok"
    ABSENT = "absent"  # not stored (never, evicted, or still being written)
    WRONG_SIZE = "wrong_size"  # stored with another length than the page's object
    UNAVAILABLE = "unavailable"  # the master did not answer
    FAILED = "failed"  # a transfer or store error (a peer gone, the store full, ...)


# Mooncake ErrorCode values (mooncake-store/include/types.h)
NO_AVAILABLE_HANDLE = -200  # the store is full
INVALID_PARAMS = -600  # on a get: the buffers are smaller than the object
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
REPLICA_IS_GONE = -712
_ABSENT = {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_IS_GONE}

# The client calls of the session API (Mooncake >= 0.3.13); without them batches go through
# batch_get_into_multi_buffers / batch_put_from_multi_buffers.
SESSION_API = ("batch_get_replica_desc", "batch_get_session_start", "batch_get_into_multi_buffer_ranges",
               "batch_get_session_end", "batch_put_session_start", "batch_put_from_multi_buffer_ranges",
               "batch_put_session_end", "batch_put_session_revoke")


def _offsets(sizes: list[int]) -> list[int]:
    """Where each buffer of an object starts in the object."""
    return list(accumulate(sizes[:-1], initial=0))


def classify(code: int, expected: int | None = None) -> Outcome:
    """The outcome of one key's return ``code``; ``expected``: the byte count of a whole get."""
    if code >= 0:
        return Outcome.OK if expected is None or code == expected else Outcome.WRONG_SIZE
    if code in _ABSENT:
        return Outcome.ABSENT
    if code == OBJECT_ALREADY_EXISTS:  # a put of a key someone stored first: the page is there
        return Outcome.OK
    if -999 <= code <= -900:  # RPC_FAIL and the heartbeat RPC errors
        return Outcome.UNAVAILABLE
    if code == INVALID_PARAMS and expected is not None:
        return Outcome.WRONG_SIZE
    return Outcome.FAILED


class MooncakeUnavailable(StorageBackendError):
    """The master is unreachable: a miss for the caller, logged once when it starts."""

    quiet = True


class MooncakeClient:
    """One ``MooncakeDistributedStore`` set up for this rank. Thread-safe (Mooncake's client is)."""

    def __init__(self, options: MooncakeOptions, segment_bytes: int, device_name: str):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("the mooncake backend needs the Mooncake wheel (pip install 'sglang[mooncake]') and "
                              f"Debian's libibverbs1 and librdmacm1: {exc}") from exc
        bound_tcp_timeouts(options.transfer_timeout_s)
        self.store = MooncakeDistributedStore()
        kwargs = {} if options.tenant_id == "default" else {"tenant_id": options.tenant_id}
        code = self.store.setup(options.local_hostname, options.metadata_server, segment_bytes,
                                DEFAULT_LOCAL_BUFFER_SIZE, options.protocol, device_name,
                                options.master_server_address, **kwargs)
        if code != 0:
            raise StorageBackendError(f"Mooncake setup failed (code {code}) with master "
                                      f"{options.master_server_address}, metadata server {options.metadata_server}, "
                                      f"protocol {options.protocol}")
        self.master = options.master_server_address
        self.session_api = all(hasattr(self.store, name) for name in SESSION_API)
        self._registered: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()
        self._down_since: float | None = None  # when an RPC failed; None: the master answers
        self._saw_unreachable = False  # health_check() reported the master unreachable since then

    # ---- memory -------------------------------------------------------------------------
    def register(self, address: int, nbytes: int) -> None:
        """Register host memory for zero-copy transfers (once per address)."""
        with self._lock:
            if nbytes == 0 or self._registered.get(address, -1) >= nbytes:
                return
            code = self.store.register_buffer(address, nbytes)
            if code != 0:
                raise StorageBackendError(f"Mooncake register_buffer of {nbytes} bytes failed (code {code})")
            self._registered[address] = nbytes

    # ---- availability -------------------------------------------------------------------
    def check_available(self, what: str) -> None:
        """Raise MooncakeUnavailable while the master is known to be unreachable.

        Mooncake's ``health_check()`` still answers "healthy" for a few seconds after the master
        died, until its heartbeat notices, and each call then waits out a reconnect attempt. So
        after an RPC failure calls miss at once until the heartbeat has reported the master
        unreachable and then back (or, if it never reported it, PROBE_AFTER_S later: one call
        then tries again)."""
        if self._down_since is None:
            return
        healthy = self.store.health_check() == 0
        with self._lock:
            if self._down_since is None:
                return
            if not healthy:
                self._saw_unreachable = True
                raise MooncakeUnavailable(f"Mooncake {what} skipped: master {self.master} unreachable")
            if not self._saw_unreachable and time.monotonic() - self._down_since < PROBE_AFTER_S:
                raise MooncakeUnavailable(f"Mooncake {what} skipped: master {self.master} failed an RPC")
            logger.warning("Mooncake master %s: calls resume after %.1fs", self.master,
                           time.monotonic() - self._down_since)
            self._down_since = None

    def _settle(self, what: str, outcomes: list[Outcome]) -> list[Outcome]:
        if Outcome.UNAVAILABLE in outcomes:
            with self._lock:
                if self._down_since is None:
                    self._down_since, self._saw_unreachable = time.monotonic(), False
                    logger.warning("Mooncake master %s unreachable during %s: storage calls miss until it returns",
                                   self.master, what)
        return outcomes

    # ---- batched calls ------------------------------------------------------------------
    def exists(self, names: list[str]) -> list[Outcome]:
        """One query for every name: OK (stored), ABSENT, UNAVAILABLE or FAILED."""
        self.check_available("exists")
        codes = self.store.batch_is_exist([KEY_PREFIX + n for n in names])
        return self._settle("exists", [Outcome.OK if c == 1 else Outcome.ABSENT if c == 0 else classify(c)
                                       for c in codes])

    def get_into(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[Outcome]:
        """Read object i into the buffers ``ptrs[i]`` (``sizes[i]`` bytes each, registered); an
        object stored with another length than ``sum(sizes[i])`` is WRONG_SIZE (nothing read).

        Through a get session (:data:`SESSION_API`): the stored sizes (one master query), one
        session start (the master's replica lookup, leased), one ranged read of every buffer of
        every object, then the session's end. Mooncake moves a ranged batch as one scatter
        transfer, which over TCP (0.3.13) ran at 1.0-1.4x the speed of ``batch_get_into`` of the
        same pages (even on a quiet machine, ahead under load), where
        ``batch_get_into_multi_buffers`` ran 1.1-1.7x slower than this path with the same
        objects (``scripts/bench/bench_storage.py --mooncake``, 1 MiB pages). Each buffer of an
        object is still a TCP request of its own (about 55 us): see ``batch_plan.py`` for the
        small pages that are staged into one buffer."""
        self.check_available("get")
        keys = [KEY_PREFIX + n for n in names]
        totals = [sum(s) for s in sizes]
        if not self.session_api:
            codes = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
            return self._settle("get", [classify(c, t) for c, t in zip(codes, totals)])
        stored = self._stored_sizes(keys)
        outcomes: list[Outcome | None] = [
            Outcome.WRONG_SIZE if stored.get(k, t) != t else None for k, t in zip(keys, totals)]
        todo = [i for i, o in enumerate(outcomes) if o is None]
        if not todo:
            return self._settle("get", outcomes)
        # Keys the size query did not list go through the session start too: its codes tell an
        # absent key from an unreachable master (the size query answers {} for both).
        codes = self.store.batch_get_session_start([keys[i] for i in todo])
        started = [i for i, code in zip(todo, codes) if code == 0]
        for i, code in zip(todo, codes):
            if code != 0:
                outcomes[i] = classify(code)
            elif keys[i] not in stored:
                outcomes[i] = Outcome.ABSENT  # stored after the size query: a miss this time
        read = [i for i in started if outcomes[i] is None]
        try:
            if read:
                codes = self.store.batch_get_into_multi_buffer_ranges(
                    [keys[i] for i in read], [ptrs[i] for i in read], [sizes[i] for i in read],
                    [_offsets(sizes[i]) for i in read])
                for i, code in zip(read, codes):
                    outcomes[i] = classify(code, totals[i])
        finally:
            if started:
                self.store.batch_get_session_end([keys[i] for i in started])
        return self._settle("get", outcomes)

    def _stored_sizes(self, keys: list[str]) -> dict[str, int]:
        """Stored length of every listed key with a memory replica (one master query; {} when
        the master did not answer). A ranged read does not compare the object's length with its
        buffers (a longer object would yield its first bytes), so the length is checked here."""
        sizes = {}
        for key, replicas in self.store.batch_get_replica_desc(keys).items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[key] = replica.get_memory_descriptor().buffer_descriptor.size
                    break
        return sizes

    def put_from(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[Outcome]:
        """Store object i from the buffers ``ptrs[i]``. A key already stored (or being stored by
        another writer) stays as it is (Mooncake keeps the first write); its outcome is OK.

        Through a put session (:data:`SESSION_API`): one session start (the master reserves
        every object), one ranged write of every buffer of every object (one scatter transfer,
        as in :meth:`get_into`), then the end of the objects written whole, which makes them
        readable, and the revoke of the others, so a failed write never leaves a readable
        object behind (a put session ended without its write would serve whatever its space
        held)."""
        self.check_available("set")
        keys = [KEY_PREFIX + n for n in names]
        if not self.session_api:
            codes = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
            self._log_full(codes)
            return self._settle("set", [classify(c) for c in codes])
        totals = [sum(s) for s in sizes]
        codes = self.store.batch_put_session_start(keys, totals)
        self._log_full(codes)
        outcomes = [Outcome.FAILED if code == 0 else classify(code) for code in codes]  # 0: not yet written
        started = [i for i, code in enumerate(codes) if code == 0]
        written: list[int] = []
        try:
            if started:
                codes = self.store.batch_put_from_multi_buffer_ranges(
                    [keys[i] for i in started], [ptrs[i] for i in started], [sizes[i] for i in started],
                    [_offsets(sizes[i]) for i in started])
                written = [i for i, code in zip(started, codes) if code == totals[i]]
                for i, code in zip(started, codes):
                    if code < 0:
                        outcomes[i] = classify(code)
        finally:
            whole = set(written)
            torn = [keys[i] for i in started if i not in whole]
            if torn:  # never readable: the master releases their space
                self.store.batch_put_session_revoke(torn)
        if written:
            for i, code in zip(written, self.store.batch_put_session_end([keys[i] for i in written])):
                outcomes[i] = Outcome.OK if code == 0 else classify(code)
        return self._settle("set", outcomes)

    @staticmethod
    def _log_full(codes: list[int]) -> None:
        if NO_AVAILABLE_HANDLE in codes:
            logger.debug("Mooncake store full: %d of %d objects not stored", codes.count(NO_AVAILABLE_HANDLE),
                         len(codes))

    def get_bytes(self, name: str) -> bytes:
        """The object's bytes through Mooncake's local buffer (b"" when absent)."""
        self.check_available("get")
        return self.store.get(KEY_PREFIX + name)

    def put_parts(self, name: str, parts: list) -> Outcome:
        """Store one object from unregistered memory (copied through Mooncake's local buffer)."""
        self.check_available("set")
        return self._settle("set", [classify(self.store.put_parts(KEY_PREFIX + name, *parts))])[0]

    def size_of(self, name: str) -> int | None:
        """The stored length of ``name``; None when absent or unknown."""
        size = self.store.get_size(KEY_PREFIX + name)
        return size if size >= 0 else None

    def remove(self, names: list[str]) -> None:
        """Remove objects, leases notwithstanding (a corrupt page must not be served again)."""
        self.store.batch_remove([KEY_PREFIX + n for n in names], True)

    def clear(self) -> int:
        """Remove every page this fork stored in the store (all deployments sharing it)."""
        return self.store.remove_by_regex(f"^{KEY_PREFIX}.*", True)

    def close(self) -> None:
        with self._lock:
            registered, self._registered = self._registered, {}
        for address in registered:
            self.store.unregister_buffer(address)
        self.store.close()
