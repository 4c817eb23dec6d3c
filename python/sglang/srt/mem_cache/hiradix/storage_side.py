"""The L3 (storage) side of HiRadixCache: prefetch into host-only nodes, backup of host copies.

Prefetch, for a waiting request (scheduler thread unless noted):

1. ``prefetch_from_storage(req_id, last_host_node, new_input_tokens)`` pins ``last_host_node``
   (``protect_host``), names the pages after it by the tree's hash chain and queues their
   existence check (prefetch thread, chunks of 128 pages).
2. ``check_hicache_events`` (every step) agrees with MIN how many queued checks are done on
   every rank, then the hit pages of each (one more MIN), reserves host slots for them
   (``_reserve``: agreed, evicting host leaves if needed) and starts the reads (IO thread).
3. ``check_prefetch_progress(req_id)`` (every step while the request waits) agrees with MIN on
   [all reads done, within the time budget, pages arrived]; by the stop policy it returns
   False (keep waiting) or ends the prefetch: the pages that arrived on every rank become
   host-only nodes under ``last_host_node`` (pages the tree got meanwhile are freed), the pin
   goes, the rest of the reservation is freed once the IO thread lets go of it.
4. A miss (agreed: nothing or too little found, no host room for it, or ``best_effort`` stopped
   before the check answered) arms a paced retry (``storage_prefetch_retries``,
   ``prefetch_retries.py``); ``pop_due_prefetch_retries`` (once per scheduling pass) ends the
   missed prefetch of each request whose retry is due, and the scheduler issues its check again.
   A check stopped by a time budget is not retried.

Backup: when a host copy is acknowledged on every rank (``_on_write_done``), its pages are
queued to the backup thread with their hashes (and, in a hybrid tree, ``_backup_states``: the
trailing states to store beside them), the host copy pinned; ``check_hicache_events`` agrees
how many backups finished (MIN) and unpins them.

Trailing states (``STORAGE_STATE_POOL``, Mamba): the hit agreed for a prefetch is the longest
prefix whose last page's state is stored on every rank that asked (MIN of each rank's longest);
its reservation takes one state slot; it counts as arrived only when every page and the state
did (``PrefetchOperation.usable_pages``), so a tree never gets KV without its state.

Flush: ``_drain_storage`` waits at most ``flush_timeout_s`` (extra config) for storage
operations; what is still running then is abandoned: prefetch reads keep their reserved slots
(``holding``), backups' host slots are quarantined (``abandon_backups``), both counted as held
by the integrity check and freed by ``reap`` once their thread returns; ``reset`` then raises
``HiCacheFlushIncomplete`` on every rank (the verdict is agreed).

Collectives: every call above makes the same number of all-reduces on every rank whatever the
local I/O did, because each count it branches on is an agreed value.

A mixin of HiRadixCache: it uses the tree's ``cache_controller``, ``agreement``, ``KV``,
``page_size``, ``_reserve``, ``_step``, ``protect_host``/``release_host``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from sglang.srt.managers.cache_controller import Tier
from sglang.srt.mem_cache.radix.events import StorageMedium
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.srt.mem_cache.controller.hicache_config import PrefetchPolicy
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.controller.storage_ops import HiCacheFlushIncomplete, PrefetchOperation, PrefetchState, StorageOperation
from sglang.srt.mem_cache.controller.storage_settings import PrefetchRetrySettings
from sglang.srt.mem_cache.hiradix.prefetch_retries import StoragePrefetchRetries
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode

logger = logging.getLogger(__name__)

MAX_LOADED_RECORDS = 4096  # prefetch_loaded_tokens entries kept for requests nobody asked about


class StorageTreeMixin:
    STORAGE_STATE_POOL: PoolName | None = None  # the trailing state pool this tree can take from L3

    def _init_storage(self, prefetch_stop_policy, prefetch_retry: PrefetchRetrySettings | None = None) -> None:
        self.prefetch_stop_policy = PrefetchPolicy.parse(prefetch_stop_policy)
        self.storage_prefetch_retries = StoragePrefetchRetries(prefetch_retry)
        self.storage = self.cache_controller.storage  # None: no L3
        state_pool = self.storage.state_pool if self.storage is not None else None
        if state_pool is not self.STORAGE_STATE_POOL and state_pool is not None:
            raise ValueError(f"{type(self).__name__} cannot take {state_pool.value!r} states from L3; "
                             "use the tree of that hybrid stack (e.g. HiMambaRadixCache)")
        self.ongoing_prefetch: dict[str, PrefetchOperation] = {}
        self.prefetch_loaded_tokens: OrderedDict[str, int] = OrderedDict()
        self._write_tokens: dict[int, int] = {}  # node id -> tokens of its host write (splits move them up)

    @property
    def enable_storage(self) -> bool:
        return self.storage is not None

    # ---- prefetch -----------------------------------------------------------------------
    def prefetch_from_storage(self, req_id: str, last_host_node: TreeNode, new_input_tokens, last_hash=None,
                              prefix_keys=None, extra_key: str | None = None) -> int:
        """Start fetching the pages of ``new_input_tokens`` (the tokens right after
        ``last_host_node``, e.g. the match's ``last_host_node``) from storage.

        ``last_hash``, when given, must be ``last_host_node``'s last page hash (a check);
        ``extra_key`` names the namespace when ``last_host_node`` is the root; ``prefix_keys``
        is accepted for upstream compatibility and unused. Returns the tokens asked for (whole
        pages), 0 when nothing was started (no storage, or fewer than ``prefetch_threshold``).
        Mutates: pins ``last_host_node`` until the prefetch ends.
        """
        if self.storage is None:
            return 0
        if req_id in self.ongoing_prefetch:
            raise ValueError(f"request {req_id!r} already has a prefetch in flight")
        self._check_attached(last_host_node, "prefetch_from_storage")
        P = self.page_size
        tokens = [int(t) for t in new_input_tokens]
        tokens = tokens[: len(tokens) // P * P]
        if not tokens or len(tokens) < self.storage.settings.prefetch_threshold:
            self.storage.count(prefetch_skipped=1)
            return 0
        extra_key, prior = self._prefetch_namespace(last_host_node, extra_key, last_hash)
        op = PrefetchOperation(req_id, last_host_node, tokens, page_hashes(tokens, P, prior), extra_key)
        self.protect_host(last_host_node)
        self.ongoing_prefetch[req_id] = op
        self.storage.submit_query(op)
        return len(tokens)

    def _prefetch_namespace(self, node: TreeNode, extra_key: str | None, last_hash) -> tuple[str | None, str]:
        """(namespace, prior page hash) of pages after ``node``; ValueError when ``extra_key`` or
        ``last_hash`` contradict the node."""
        if node is self.root_node:
            prior = namespace_hash(extra_key)
        else:
            if extra_key is not None and extra_key != node.key.extra_key:
                raise ValueError(f"extra_key {extra_key!r} differs from the node's {node.key.extra_key!r}")
            extra_key, prior = node.key.extra_key, node.hash_value[-1]
        if last_hash is not None and last_hash != prior:
            raise ValueError("last_hash is not the last page hash of last_host_node")
        return extra_key, prior

    def _time_budget(self, op: PrefetchOperation) -> float:
        settings = self.storage.settings
        if self.prefetch_stop_policy is PrefetchPolicy.TIMEOUT:
            return settings.timeout_budget(op.hit_pages * self.page_size)
        return settings.prefetch_timeout_max

    def check_prefetch_progress(self, req_id: str) -> bool:
        """True when ``req_id`` may be scheduled: it has no prefetch, or its prefetch just ended
        (its pages, if any, are host-only nodes now: match again). False: keep waiting.

        Call it on every rank for the same requests in the same order: each call with a
        prefetch in flight makes one all-reduce."""
        op = self.ongoing_prefetch.get(req_id)
        if op is None:
            return True
        local_done = op.state is PrefetchState.FINISHED or (op.state is PrefetchState.LOADING and op.io_done)
        in_time = op.elapsed() < self._time_budget(op)
        arrived = op.usable_pages()
        done, in_time, arrived = self.agreement.min([int(local_done), int(in_time), arrived])
        if not (done or not in_time or self.prefetch_stop_policy is PrefetchPolicy.BEST_EFFORT):
            return False
        if not done and not in_time:
            self.storage.count(prefetch_timeouts=1)
        elif op.state is PrefetchState.QUERYING:  # best_effort stopped before the check answered
            self.storage_prefetch_retries.poll_miss(req_id)
        self._end_prefetch(op, arrived, "deadline" if not done and not in_time else "storage_transfer")
        return True

    def _end_prefetch(self, op: PrefetchOperation, keep_pages: int, short_reason: str = "dropped") -> None:
        """Insert the first ``keep_pages`` pages (arrived on every rank), unpin, release the rest.
        ``short_reason``: upstream's unfulfilled reason of the hit pages a read leaves behind."""
        if op.state is PrefetchState.LOADING and op.hit_pages > keep_pages:
            short = (op.hit_pages - keep_pages) * self.page_size
            self.storage.count(**{f"prefetch_unfulfilled_tokens_{short_reason}": short})
        op.terminated = op.cancel = True
        del self.ongoing_prefetch[op.request_id]
        keep = keep_pages * self.page_size
        inserted, state_taken = 0, False
        if keep:
            dup, state_taken = self._insert_prefetched(op, keep)
            if dup:
                self.cache_controller.free(Tier.HOST, self.KV, op.host_indices[:dup])
            inserted = keep - dup
            self.storage.count(prefetch_pages_loaded=keep_pages, prefetch_pages_duplicate=dup // self.page_size)
        self.release_host(op.last_node)
        if op.state is PrefetchState.LOADING:
            self.storage.release_prefetch(op, keep, state_taken)
        op.state = PrefetchState.FINISHED
        if inserted:
            self.prefetch_loaded_tokens[op.request_id] = inserted
            while len(self.prefetch_loaded_tokens) > MAX_LOADED_RECORDS:
                self.prefetch_loaded_tokens.popitem(last=False)
        logger.debug("prefetch %s ended: %d of %d pages kept", op.request_id, keep_pages, op.hit_pages)

    def _insert_prefetched(self, op: PrefetchOperation, keep: int) -> tuple[int, bool]:
        """Insert ``op``'s first ``keep`` tokens as host-only nodes after ``op.last_node``.
        Returns (leading tokens the tree already held: the caller frees those slots, whether
        the tree took ``op.state_host``)."""
        key = RadixKey(op.tokens[:keep], op.extra_key)
        return self._insert_host_from(op.last_node, key, op.host_indices[:keep]), False

    def pop_prefetch_loaded_tokens(self, req_id: str) -> int:
        """Tokens that ``req_id``'s prefetch added to the tree (0 if none); forgets them."""
        return self.prefetch_loaded_tokens.pop(req_id, 0)

    def count_prefetch_admission_shortfall(self, num_tokens: int) -> None:
        """At admission, ``num_tokens`` tokens a prefetch added were not reused as storage hits
        (e.g. they left the host tier meanwhile): upstream's ``cache_admission_shortfall``. Its
        ``device_capacity`` does not arise: a request is admitted only with device room for its
        whole host hit (``schedule_policy.py``)."""
        if self.storage is not None and num_tokens > 0:
            self.storage.count(prefetch_unfulfilled_tokens_cache_admission_shortfall=num_tokens)

    def release_aborted_request(self, req_id: str) -> None:
        """Drop ``req_id``'s prefetch (nothing is inserted) and its retry. Same call on every
        rank; no collective."""
        self.prefetch_loaded_tokens.pop(req_id, None)
        self.storage_prefetch_retries.forget(req_id)
        op = self.ongoing_prefetch.get(req_id)
        if op is not None:
            self._end_prefetch(op, 0)

    def pop_due_prefetch_retries(self, queue_rids) -> list[str]:
        """Once per scheduling pass: the ids of ``queue_rids`` (the waiting queue, head first)
        whose L3 check is due again (``StoragePrefetchRetries.pop_ready``), in queue order. Each
        one's missed prefetch is ended (nothing to keep), so the caller can start the new one
        with ``prefetch_from_storage``. Same result on every rank; no collective."""
        due = []
        for rid in self.storage_prefetch_retries.pop_ready(queue_rids):
            op = self.ongoing_prefetch.get(rid)
            if op is not None:
                if op.state is not PrefetchState.FINISHED:  # a check in flight already: keep it
                    continue
                self._end_prefetch(op, 0)
            logger.debug("prefetch %s: L3 check re-issued (attempt %d of %d)", rid,
                         self.storage_prefetch_retries.attempts(rid), self.storage_prefetch_retries.settings.max_attempts)
            due.append(rid)
        return due

    def _start_prefetch_reads(self, ops: list[PrefetchOperation]) -> None:
        """Agree the hit pages of ``ops`` (existence checks done on every rank), reserve host
        slots for them and start the reads. One all-reduce, plus one per reservation."""
        if not ops:
            return
        hits = self.agreement.min([op.local_hit_pages for op in ops])
        threshold = self.storage.settings.prefetch_threshold
        for op, n in zip(ops, hits):
            if op.terminated:
                continue
            op.hit_pages = n
            self.storage.count(prefetch_pages_found=n)
            op.state = PrefetchState.FINISHED
            if n == 0 or n * self.page_size < threshold:
                self.storage.count(prefetch_skipped=1, prefetch_unfulfilled_tokens_below_threshold=n * self.page_size)
                self.storage_prefetch_retries.poll_miss(op.request_id)  # the pages may still be landing
                continue
            need = {self.KV: n * self.page_size}
            if self.storage.state_pool is not None:
                need[self.storage.state_pool] = 1  # the state after the last hit page
            host = self._reserve(Tier.HOST, need)
            if host is None:
                self.storage.count(prefetch_host_full=1, prefetch_unfulfilled_tokens_host_capacity=n * self.page_size,
                                   prefetch_deferred_tokens_host_capacity=n * self.page_size)
                self.storage_prefetch_retries.poll_miss(op.request_id)  # host slots free up as others finish
                continue
            op.host_indices, op.state = host[self.KV], PrefetchState.LOADING
            op.state_host = host.get(self.storage.state_pool)
            self.storage.start_io(op)

    # ---- backup -------------------------------------------------------------------------
    def _on_write_done(self, node: TreeNode) -> None:
        """A host copy was just acknowledged (splits since the write included: the write
        covered ``node`` and the ancestors split off it): record its KV events (host tier) and
        queue its L3 backup."""
        written = self._write_tokens.pop(node.id, None)
        if self.storage is None and self.kv_events is None:
            return
        if written is None:
            written = len(node.key)
        region, x, covered = [], node, 0
        while covered < written and x is not self.root_node:
            region.append(x)
            covered += len(x.key)
            x = x.parent
        region.reverse()
        if self.kv_events is not None:
            for x in region:
                self.kv_events.stored(x, StorageMedium.CPU)
        if self.storage is not None:
            self._queue_backup(region)

    def write_backup_storage(self, node: TreeNode) -> int:
        """Queue an L3 backup of ``node``'s host copy; pages queued (0: no storage or host copy)."""
        self._check_attached(node, "write_backup_storage")
        if self.storage is None or not node.backuped:
            return 0
        return self._queue_backup([node])

    def _queue_backup(self, nodes: list[TreeNode]) -> int:
        keys = [h for n in nodes for h in n.hash_value]
        host = torch.cat([n.host_value for n in nodes])
        self.protect_host(nodes[-1])
        self.storage.submit_backup(StorageOperation(nodes[-1], keys, host, self._backup_states(nodes)))
        return len(keys)

    def _backup_states(self, nodes: list[TreeNode]) -> list[tuple[int, torch.Tensor]]:
        """(page index in the backup, state host slot) of each trailing state to store with
        ``nodes``' pages; none in a plain tree."""
        return []

    # ---- per-step agreement (with check_hicache_events) ---------------------------------
    def _storage_progress(self) -> list[int]:
        if self.storage is None:
            return []
        self.storage.reap()
        return [self.storage.leading_backups_done(), self.storage.leading_queries_done()]

    def _on_storage_progress(self, agreed: list[int]) -> None:
        if self.storage is None:
            return
        backups, queries = agreed
        for op in self.storage.pop_backups(backups):
            self.release_host(op.node)
        self._start_prefetch_reads(self.storage.pop_queries(queries))

    # ---- flush and integrity ------------------------------------------------------------
    def _drain_storage(self, timeout_s: float | None) -> tuple[dict[PoolName, torch.Tensor],
                                                             HiCacheFlushIncomplete | None]:
        """Before a reset: end every prefetch (nothing kept), acknowledge host transfers, wait
        at most ``timeout_s`` (default ``flush_timeout_s``) for storage operations, abandon the
        rest. Returns (host slots of abandoned backups: not the tree's to free any more, the
        error to raise once the tree is reset, or None). Same collectives on every rank.
        ValueError (before anything is abandoned) while a request holds a lock."""
        timeout = self.storage.settings.flush_timeout_s if timeout_s is None else float(timeout_s)
        if timeout < 0:
            raise ValueError(f"reset: timeout_s must be >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout
        for op in list(self.ongoing_prefetch.values()):
            self._end_prefetch(op, 0)
        self.cache_controller.synchronize()
        self.storage.synchronize(max(deadline - time.monotonic(), 0.0))
        self.check_hicache_events()  # host writes acked now queue their backups
        if self.protected_size_:
            raise ValueError(f"reset with {self.protected_size_} tokens still locked by requests")
        self.storage.synchronize(max(deadline - time.monotonic(), 0.0))
        self.check_hicache_events()
        keep = self.storage.abandon_backups()  # the queue is the same on every rank (agreed pops)
        self.storage.reap()
        pending = self.storage.pending()
        if self.agreement.all_true(not any(pending.values())):
            return keep, None
        logger.warning("flush: storage operations still running after %.3g s: %s", timeout, pending)
        return keep, HiCacheFlushIncomplete(timeout, pending)

    def _check_storage_ops(self) -> None:
        for req_id, op in self.ongoing_prefetch.items():
            node = op.last_node
            if not self._is_attached(node) or (node is not self.root_node and node.host_ref_counter <= 0):
                raise CacheIntegrityError(f"prefetch {req_id!r}: its node {node.id} is gone or not pinned")
