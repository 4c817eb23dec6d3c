"""StorageController: the L2<->L3 side of a HiCacheController, three worker threads.

- prefetch thread: existence checks of a prefetch's pages (chunks of ``STORAGE_BATCH_SIZE``
  pages, stopping at the first chunk with a miss) -> ``op.local_hit_pages``;
- IO thread: reads the agreed hit pages into reserved host slots, chunk by chunk, advancing
  ``op.completed_pages`` by the leading pages that arrived; stops at a miss or when cancelled;
- backup thread: asks which leading pages storage already has and stores only the rest.

The threads never talk to other ranks and never touch the tree or an allocator (except
freeing a revoked prefetch's slots from the scheduler thread in ``reap``): every TP agreement
happens on the scheduler thread (``hiradix_storage.py``). Any exception or malformed result
of the backend is a miss for that operation and a counted failure; the threads keep running.

MLA (KV replicated over TP ranks): every rank calls ``batch_set``; the backend itself skips
the write on TP rank != 0 (``backup_skip``). That is the only mechanism: this class never looks
at the TP rank.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

import torch

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, PoolName, PoolTransfer, leading_hits
from sglang.srt.mem_cache.storage_ops import BackupOperation, PrefetchOperation
from sglang.srt.mem_cache.storage_settings import StorageSettings
from sglang.srt.mem_cache.transfer_lane import ThreadLane

logger = logging.getLogger(__name__)

COUNTERS = (
    "prefetch_ops",  # prefetches started (existence check queued)
    "prefetch_skipped",  # asked or found fewer tokens than prefetch_threshold
    "prefetch_host_full",  # pages found but host slots could not be reserved on every rank
    "prefetch_timeouts",  # stopped by a time budget before every found page arrived
    "prefetch_pages_found",  # agreed pages found in storage
    "prefetch_pages_loaded",  # pages inserted into the tree (agreed over ranks)
    "prefetch_pages_duplicate",  # arrived, but the tree had them meanwhile (freed)
    "backup_ops",
    "backup_pages_existing",  # already in storage: not written again
    "backup_pages_submitted",  # handed to batch_set
    "backup_pages_failed",  # batch_set returned False
    "controller_failures",  # backend calls that raised or returned a malformed result
)


class StorageController:
    """``backend``: a HiCacheStorage. ``side_pools``: pools that share the anchor's host slots
    (moved with every anchor page through the v2 API; empty -> the v1 API). ``free_host``:
    returns anchor host slots to their allocator (called on the scheduler thread only)."""

    def __init__(self, backend, page_size: int, settings: StorageSettings, side_pools: list[PoolName],
                 free_host: Callable[[torch.Tensor], None]):
        self.backend = backend
        self.page_size = page_size
        self.settings = settings
        self.side_pools = list(side_pools)
        self.free_host = free_host
        self.prefetch_lane = ThreadLane("hicache-prefetch")
        self.io_lane = ThreadLane("hicache-prefetch-io")
        self.backup_lane = ThreadLane("hicache-backup")
        self.query_queue: deque[PrefetchOperation] = deque()
        self.backup_queue: deque[BackupOperation] = deque()
        self.holding: list[PrefetchOperation] = []  # ops whose reserved slots are not all released
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._closed = False

    # ---- counters -----------------------------------------------------------------------
    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def stats(self) -> dict[str, int]:
        """Backend counters (``get_stats()``: pages_hit, bytes_read, corruptions, ...) merged
        with this controller's (``COUNTERS``); ``failures`` adds both sides' failures."""
        with self._lock:
            mine = dict(self._counts)
        try:
            backend = {k: int(v) for k, v in dict(self.backend.get_stats()).items()}
        except Exception:  # noqa: BLE001 - a broken backend must not break the stats
            logger.warning("storage backend get_stats() failed", exc_info=True)
            backend = {}
        merged = {**backend, **mine}
        merged["failures"] = backend.get("failures", 0) + mine["controller_failures"]
        return merged

    # ---- backend calls (storage threads) -----------------------------------------------
    def _call(self, what: str, fn, expect_len: int | None = None):
        """``fn()``; None (a counted failure) when it raises or returns a malformed result."""
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a backend fault is a miss, never a crash
            level = logging.ERROR if isinstance(exc, (ValueError, TypeError)) else logging.WARNING
            logger.log(level, "storage %s raised %r; treated as a miss", what, exc, exc_info=True)
            self.count(controller_failures=1)
            return None
        if expect_len is not None and (not isinstance(out, (list, tuple)) or len(out) != expect_len):
            logger.warning("storage %s returned %r, expected %d flags; treated as a miss", what, out, expect_len)
            self.count(controller_failures=1)
            return None
        return out

    def _transfers(self, keys: list[str], host: torch.Tensor | None) -> list[PoolTransfer]:
        names = [PoolName.KV, *self.side_pools]
        return [PoolTransfer(n, host_indices=host, keys=keys) for n in names]

    def exists(self, keys: list[str]) -> int | None:
        """Leading pages of ``keys`` in storage (anchor and every side pool); None on a fault."""
        if not self.side_pools:
            n = self._call("batch_exists", lambda: self.backend.batch_exists(keys))
        else:
            side = [PoolTransfer(name) for name in self.side_pools]
            res = self._call("batch_exists_v2", lambda: self.backend.batch_exists_v2(keys, side))
            n = None if res is None else res.hit_pages
        if n is None:
            return None
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(keys):
            logger.warning("storage batch_exists returned %r for %d keys; treated as a miss", n, len(keys))
            self.count(controller_failures=1)
            return None
        return n

    def _pages(self, what: str, keys: list[str], host: torch.Tensor) -> list[bool]:
        """Per page: arrived (get) / stored (set) in every pool; all False on a fault."""
        if not self.side_pools:
            fn = self.backend.batch_get_v1 if what == "get" else self.backend.batch_set_v1
            flags = self._call(f"batch_{what}_v1", lambda: fn(keys, host), len(keys))
            return [bool(f) for f in flags] if flags is not None else [False] * len(keys)
        fn = self.backend.batch_get_v2 if what == "get" else self.backend.batch_set_v2
        res = self._call(f"batch_{what}_v2", lambda: fn(self._transfers(keys, host)))
        names = [PoolName.KV, *self.side_pools]
        if not isinstance(res, dict) or any(len(res.get(n, ())) != len(keys) for n in names):
            if res is not None:
                logger.warning("storage batch_%s_v2 returned %r; treated as a miss", what, res)
                self.count(controller_failures=1)
            return [False] * len(keys)
        return [all(bool(res[n][i]) for n in names) for i in range(len(keys))]

    def _slots(self, host: torch.Tensor, first_page: int, num_pages: int) -> torch.Tensor:
        P = self.page_size
        return host[first_page * P : (first_page + num_pages) * P]

    # ---- prefetch -----------------------------------------------------------------------
    def submit_query(self, op: PrefetchOperation) -> None:
        """Queue the existence check of ``op`` (answers come back in submission order)."""
        self.query_queue.append(op)
        self.count(prefetch_ops=1)
        self.prefetch_lane.submit(lambda: self._query(op), [])

    def _query(self, op: PrefetchOperation) -> None:
        hits = 0
        try:
            for start in range(0, len(op.keys), STORAGE_BATCH_SIZE):
                if op.cancel:
                    break
                chunk = op.keys[start : start + STORAGE_BATCH_SIZE]
                n = self.exists(chunk)
                if n is None:
                    op.failed = True
                    break
                hits += n
                if n < len(chunk):
                    break
        finally:
            op.local_hit_pages = hits
            op.query_done = True

    def leading_queries_done(self) -> int:
        n = 0
        for op in self.query_queue:
            if not op.query_done:
                break
            n += 1
        return n

    def pop_queries(self, n: int) -> list[PrefetchOperation]:
        return [self.query_queue.popleft() for _ in range(n)]

    def start_io(self, op: PrefetchOperation) -> None:
        """Read ``op``'s agreed hit pages into ``op.host_indices`` on the IO thread."""
        op.held = op.host_indices
        self.holding.append(op)
        self.io_lane.submit(lambda: self._read(op), [])

    def _read(self, op: PrefetchOperation) -> None:
        try:
            for start in range(0, op.hit_pages, STORAGE_BATCH_SIZE):
                if op.cancel:
                    break
                num = min(STORAGE_BATCH_SIZE, op.hit_pages - start)
                flags = self._pages("get", op.keys[start : start + num], self._slots(op.host_indices, start, num))
                ok = leading_hits(flags)
                op.completed_pages += ok
                if ok < num:
                    op.failed = True
                    break
        finally:
            op.io_done = True

    def release_prefetch(self, op: PrefetchOperation, handed_tokens: int) -> None:
        """The tree took (or freed) ``op.held[:handed_tokens]``; free the rest as soon as the IO
        thread is done with it (now, or in a later ``reap``)."""
        op.cancel = True
        if op.held is not None:
            op.held = op.held[handed_tokens:]
        self.reap()

    def reap(self) -> None:
        """Free the slots of terminated prefetches whose reads have stopped (scheduler thread)."""
        keep = []
        for op in self.holding:
            if op.cancel and op.io_done:
                if op.held is not None and op.held.numel():
                    self.free_host(op.held)
                op.held = None
            else:
                keep.append(op)
        self.holding = keep

    def held_host_indices(self) -> list[torch.Tensor]:
        return [op.held for op in self.holding if op.held is not None and op.held.numel()]

    # ---- backup -------------------------------------------------------------------------
    def submit_backup(self, op: BackupOperation) -> None:
        self.backup_queue.append(op)
        self.count(backup_ops=1)
        self.backup_lane.submit(lambda: self._backup(op), [])

    def _backup(self, op: BackupOperation) -> None:
        try:
            existing = 0
            for start in range(0, len(op.keys), STORAGE_BATCH_SIZE):
                chunk = op.keys[start : start + STORAGE_BATCH_SIZE]
                n = self.exists(chunk)
                existing += n or 0
                if n != len(chunk):
                    break
            self.count(backup_pages_existing=existing)
            for start in range(existing, len(op.keys), STORAGE_BATCH_SIZE):
                num = min(STORAGE_BATCH_SIZE, len(op.keys) - start)
                flags = self._pages("set", op.keys[start : start + num], self._slots(op.host_indices, start, num))
                failed = num - sum(flags)
                self.count(backup_pages_submitted=num, backup_pages_failed=failed)
                op.failed = op.failed or failed > 0
        finally:
            op.done = True

    def leading_backups_done(self) -> int:
        n = 0
        for op in self.backup_queue:
            if not op.done:
                break
            n += 1
        return n

    def pop_backups(self, n: int) -> list[BackupOperation]:
        return [self.backup_queue.popleft() for _ in range(n)]

    # ---- lifecycle ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until every queued query, read and backup has run."""
        for lane in (self.prefetch_lane, self.io_lane, self.backup_lane):
            lane.synchronize()

    def close(self) -> None:
        """Stop the threads (after their current job) and close the backend; idempotent."""
        if self._closed:
            return
        self._closed = True
        for op in list(self.query_queue) + self.holding:
            op.cancel = True
        for lane in (self.prefetch_lane, self.io_lane, self.backup_lane):
            lane.close()
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001
            logger.warning("storage backend close() failed", exc_info=True)
