"""StorageController: the L2<->L3 side of a HiCacheController, three worker threads.

- prefetch thread: existence checks of a prefetch's pages (chunks of ``STORAGE_BATCH_SIZE``
  pages, stopping at the first chunk with a miss) -> ``op.local_hit_pages``;
- IO thread: reads the agreed hit pages into reserved host slots, chunk by chunk, advancing
  ``op.completed_pages`` by the leading pages that arrived; stops at a miss or when cancelled;
  with a state pool it then reads the state after the last hit page (only when every page
  arrived: KV without its state is never used). A read that failed while the backend may still
  write host memory (``host_writes_settled``) keeps its slots until the backend says it ended;
- backup thread: asks which leading pages storage already has and stores only the rest, with
  the trailing states of the backed-up nodes (a state whose pages are already stored is
  checked and stored on its own).

The threads never talk to other ranks and never touch the tree or an allocator (except
freeing a revoked prefetch's slots from the scheduler thread in ``reap``): every TP agreement
happens on the scheduler thread (``hiradix_storage.py``). Backend calls and the checks of
their answers are in ``storage_backend_calls.py``: a fault is a miss and a counted failure.

A bounded flush (``synchronize(timeout_s)`` then ``abandon_backups``) leaves operations running:
a prefetch read keeps its reserved slots in ``holding``, an abandoned backup keeps its host
slots in ``quarantine``; ``reap`` frees both once their thread is done with them.

MLA (KV replicated over TP ranks): every rank calls ``batch_set``; the backend itself skips
the write on TP rank != 0 (``backup_skip``). That is the only mechanism: this class never looks
at the TP rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, PoolName, leading_hits
from sglang.srt.mem_cache.controller.backend_calls import BackendCalls
from sglang.srt.mem_cache.controller.storage_ops import PrefetchOperation, Quarantine, StorageOperation
from sglang.srt.mem_cache.controller.storage_settings import StorageSettings
from sglang.srt.mem_cache.controller.transfer_lane import CpuEvent, ThreadLane

logger = logging.getLogger(__name__)

# upstream's reason labels; the ones our prefetch can reach are counted (storage_side.py,
# schedule_policy.py), the rest stay 0 (buffer_only host memory, aux windows: not built here;
# device_capacity: admission waits for device room for the whole host hit)
PREFETCH_UNFULFILLED_REASONS = (
    "below_threshold", "host_capacity", "device_capacity", "device_covered", "storage_transfer", "deadline",
    "anchor_lost", "aux_window_trim", "device_overlap", "cache_admission_shortfall", "dropped",
)
PREFETCH_DEFERRED_REASONS = ("host_capacity", "device_capacity")

COUNTERS = (
    "prefetch_ops",  # prefetches started (existence check queued)
    "prefetch_skipped",  # asked or found fewer tokens than prefetch_threshold
    "prefetch_host_full",  # pages found but host slots could not be reserved on every rank
    "prefetch_timeouts",  # stopped by a time budget before every found page arrived
    "prefetch_pages_found",  # agreed pages found in storage
    "prefetch_pages_loaded",  # pages inserted into the tree (agreed over ranks)
    "prefetch_pages_duplicate",  # arrived, but the tree had them meanwhile (freed)
    "prefetch_state_misses",  # every page arrived but the state after them did not (nothing kept)
    "prefetch_reads_unsettled",  # failed reads whose slots waited for a late transfer to end
    "backup_ops",
    "backup_pages_existing",  # already in storage: not written again
    "backup_pages_submitted",  # handed to batch_set
    "backup_pages_failed",  # batch_set returned False
    "backup_states_existing",  # trailing states already in storage
    "backup_states_submitted",
    "backup_states_failed",
    "flush_abandoned_backups",  # backups a bounded flush stopped waiting for (slots quarantined)
    "controller_failures",  # backend calls that raised or returned a malformed result
    # upstream's storage_prefetch_{unfulfilled,deferred}_tokens_total, one counter per reason
    # (tokens of agreed storage hits that did not become a usable prefetch; see docs/server.md)
    *(f"prefetch_unfulfilled_tokens_{r}" for r in PREFETCH_UNFULFILLED_REASONS),
    *(f"prefetch_deferred_tokens_{r}" for r in PREFETCH_DEFERRED_REASONS),
)


class StorageController:
    """``backend``: a HiCacheStorage. ``side_pools``: pools that share the anchor's host slots
    (moved with every anchor page through the v2 API; empty -> the v1 API). ``state_pool``:
    a pool of trailing states with slots of its own (Mamba), or None. ``free_host(name,
    slots)``: returns host slots of pool ``name`` to their allocator (scheduler thread only)."""

    def __init__(self, backend, page_size: int, settings: StorageSettings, side_pools: list[PoolName],
                 free_host: Callable[[PoolName, torch.Tensor], None], state_pool: PoolName | None = None):
        self.backend = backend
        self.page_size = page_size
        self.settings = settings
        self.side_pools = list(side_pools)
        self.state_pool = state_pool
        self.free_host = free_host
        self.calls = BackendCalls(backend, self.side_pools, state_pool, self.count)
        self.prefetch_lane = ThreadLane("hicache-prefetch")
        self.io_lane = ThreadLane("hicache-prefetch-io")
        self.backup_lane = ThreadLane("hicache-backup")
        self.query_queue: deque[PrefetchOperation] = deque()
        self.backup_queue: deque[StorageOperation] = deque()
        self.holding: list[PrefetchOperation] = []  # ops whose reserved slots are not all released
        self.quarantine: list[Quarantine] = []
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
        """``op.local_hit_pages``: leading stored pages; with a state pool, the longest of
        those prefixes whose trailing state is stored."""
        usable = 0
        try:
            for start in range(0, len(op.keys), STORAGE_BATCH_SIZE):
                if op.cancel:
                    break
                chunk = op.keys[start : start + STORAGE_BATCH_SIZE]
                got = self.calls.exists(chunk)
                if got is None:
                    op.failed = True
                    break
                leading, chunk_usable = got
                if chunk_usable:
                    usable = start + chunk_usable
                if leading < len(chunk):
                    break
        finally:
            op.local_hit_pages = usable
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
        """Read ``op``'s agreed hit pages into ``op.host_indices`` (and its trailing state into
        ``op.state_host``) on the IO thread."""
        op.held, op.state_held = op.host_indices, op.state_host
        self.holding.append(op)
        self.io_lane.submit(lambda: self._read(op), [])

    def _read(self, op: PrefetchOperation) -> None:
        try:
            for start in range(0, op.hit_pages, STORAGE_BATCH_SIZE):
                if op.cancel:
                    break
                num = min(STORAGE_BATCH_SIZE, op.hit_pages - start)
                flags, _ = self.calls.pages("get", op.keys[start : start + num],
                                            self._slots(op.host_indices, start, num))
                ok = leading_hits(flags)
                op.completed_pages += ok
                if ok < num:
                    op.failed = True
                    break
            if op.state_host is not None and op.completed_pages == op.hit_pages > 0 and not op.cancel:
                op.state_ok = self.calls.states("get", [op.keys[op.hit_pages - 1]], [op.state_host])[0]
                if not op.state_ok:
                    op.failed = True
                    self.count(prefetch_state_misses=1)
        finally:
            if op.failed and not self._host_settled():
                op.unsettled = True
                self.count(prefetch_reads_unsettled=1)
            op.io_done = True

    def _host_settled(self) -> bool:
        """Whether no failed read can still write host memory (``host_writes_settled``); a
        backend that cannot say is trusted, one whose answer raises is not."""
        settled = getattr(self.backend, "host_writes_settled", None)
        if settled is None:
            return True
        try:
            return bool(settled())
        except Exception:  # noqa: BLE001 - keep the slots rather than risk a late write into reused ones
            logger.warning("storage backend host_writes_settled() failed", exc_info=True)
            return False

    def _read_over(self, op: PrefetchOperation) -> bool:
        """``op``'s IO thread is done and no late transfer can still write its slots."""
        if not op.io_done:
            return False
        if op.unsettled and self._host_settled():
            op.unsettled = False
        return not op.unsettled

    def release_prefetch(self, op: PrefetchOperation, handed_tokens: int, state_handed: bool = False) -> None:
        """The tree took (or freed) ``op.held[:handed_tokens]`` and, with ``state_handed``, the
        state slot; free the rest as soon as the IO thread is done with it (now, or in a later
        ``reap``)."""
        op.cancel = True
        if op.held is not None:
            op.held = op.held[handed_tokens:]
        if state_handed:
            op.state_held = None
        self.reap()

    def reap(self) -> None:
        """Free the slots of terminated prefetches whose reads have stopped, and of abandoned
        backups whose writes have (scheduler thread)."""
        keep = []
        for op in self.holding:
            if op.cancel and self._read_over(op):
                if op.held is not None and op.held.numel():
                    self.free_host(PoolName.KV, op.held)
                if op.state_held is not None:
                    self.free_host(self.state_pool, op.state_held)
                op.held = op.state_held = None
            else:
                keep.append(op)
        self.holding = keep
        still = []
        for q in self.quarantine:
            if q.released():
                for name, slots in q.slots.items():
                    self.free_host(name, slots)
                logger.info("storage: %d abandoned backups returned; their host slots are free", len(q.ops))
            else:
                still.append(q)
        self.quarantine = still

    def held_host_indices(self, name: PoolName = PoolName.KV) -> list[torch.Tensor]:
        """Host slots of pool ``name`` held by in-flight prefetches and quarantined backups."""
        if name is PoolName.KV:
            held = [op.held for op in self.holding if op.held is not None and op.held.numel()]
        else:
            held = [op.state_held for op in self.holding if op.state_held is not None and name is self.state_pool]
        return held + [q.slots[name] for q in self.quarantine if name in q.slots]

    # ---- backup -------------------------------------------------------------------------
    def submit_backup(self, op: StorageOperation) -> None:
        self.backup_queue.append(op)
        self.count(backup_ops=1)
        self.backup_lane.submit(lambda: self._backup(op), [])

    def _backup(self, op: StorageOperation) -> None:
        try:
            existing = 0
            for start in range(0, len(op.keys), STORAGE_BATCH_SIZE):
                chunk = op.keys[start : start + STORAGE_BATCH_SIZE]
                got = self.calls.exists(chunk, with_state=False)
                existing += got[0] if got is not None else 0
                if got is None or got[0] != len(chunk):
                    break
            self.count(backup_pages_existing=existing)
            self._backup_stored_pages_states(op, existing)
            for start in range(existing, len(op.keys), STORAGE_BATCH_SIZE):
                num = min(STORAGE_BATCH_SIZE, len(op.keys) - start)
                states = [(i - start, slot) for i, slot in op.states if start <= i < start + num]
                flags, state_flags = self.calls.pages("set", op.keys[start : start + num],
                                                      self._slots(op.host_indices, start, num), states)
                failed, states_failed = num - sum(flags), len(states) - sum(state_flags)
                self.count(backup_pages_submitted=num, backup_pages_failed=failed,
                           backup_states_submitted=len(states), backup_states_failed=states_failed)
                op.failed = op.failed or failed > 0 or states_failed > 0
        finally:
            op.done = True

    def _backup_stored_pages_states(self, op: StorageOperation, existing: int) -> None:
        """States after pages storage already has: stored unless found (a shorter prefix may
        have been stored without its state, e.g. as part of a longer one)."""
        for i, slot in op.states:
            if i >= existing:
                continue
            got = self.calls.exists([op.keys[i]])
            if got is not None and got[1] == 1:
                self.count(backup_states_existing=1)
                continue
            ok = self.calls.states("set", [op.keys[i]], [slot])[0]
            self.count(backup_states_submitted=1, backup_states_failed=int(not ok))
            op.failed = op.failed or not ok

    def leading_backups_done(self) -> int:
        n = 0
        for op in self.backup_queue:
            if not op.done:
                break
            n += 1
        return n

    def pop_backups(self, n: int) -> list[StorageOperation]:
        return [self.backup_queue.popleft() for _ in range(n)]

    # ---- flush --------------------------------------------------------------------------
    def abandon_backups(self) -> dict[PoolName, torch.Tensor]:
        """Take every queued backup out of the queue without waiting for it (a bounded flush)
        and quarantine its host slots until its thread is done. Returns those slots per pool:
        the caller (the tree being reset) must not free them."""
        ops = list(self.backup_queue)
        self.backup_queue.clear()
        if not ops:
            return {}
        slots = {PoolName.KV: torch.unique(torch.cat([op.host_indices for op in ops]))}
        states = [slot.view(-1) for op in ops for _, slot in op.states]
        if states:
            slots[self.state_pool] = torch.unique(torch.cat(states))
        self.quarantine.append(Quarantine(ops, slots))
        self.count(flush_abandoned_backups=len(ops))
        logger.warning("storage: flush abandoned %d backups still running; %d host slots quarantined",
                       len(ops), sum(s.numel() for s in slots.values()))
        return slots

    def pending(self) -> dict[str, int]:
        """Operations a storage thread has not finished: backups (queued or quarantined),
        prefetch reads still holding slots, existence checks."""
        quarantined = [op for q in self.quarantine for op in q.ops]
        return {
            "backups": sum(not op.done for op in [*self.backup_queue, *quarantined]),
            "reads": sum(not self._read_over(op) for op in self.holding),
            "queries": sum(not op.query_done for op in self.query_queue),
        }

    # ---- lifecycle ----------------------------------------------------------------------
    def synchronize(self, timeout_s: float | None = None) -> bool:
        """Wait until every query, read and backup submitted so far has run; with ``timeout_s``
        wait at most that long in all (a hung backend). True when everything ran."""
        markers = []
        for lane in (self.prefetch_lane, self.io_lane, self.backup_lane):
            done = CpuEvent(armed=True)
            lane.submit(done.record, [done])
            markers.append(done)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for done in markers:
            try:
                done.synchronize(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                return False
        return True

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
