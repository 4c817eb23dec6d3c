"""StoragePrefetchRetries: which queued requests get their L3 existence check again, and when
(upstream's ``--hicache-storage-prefetch-retry-poll-interval`` / ``-max-attempts``).

A prefetch's existence check can run before the pages it looks for land: a backup still being
written (by this server after a flush, or by another server sharing the storage). When the
agreed answer of a check is a miss (nothing found, fewer pages than ``prefetch_threshold``, no
host room for what was found, or the check had not answered when a ``best_effort`` request
stopped waiting), the tree arms a retry for the request (``poll_miss``). The scheduler asks once
per scheduling pass which armed retries are due (``pop_ready``, in waiting-queue order) and
issues those checks again. The rules are upstream's:

- a retry is due ``poll_interval`` passes after the first pass that saw it armed;
- a request re-issues at most ``max_attempts`` checks; past that it runs with what the tree holds;
- the retry of the request at the head of the queue is dropped: a retry never delays the request
  that is next in line (an idle server with a cold L3 serves at once), it only uses time a
  request waits anyway behind others;
- a check that a time budget stopped (the ``timeout`` policy, ``prefetch_timeout_max``) is not
  retried, and neither is a prefetch too short to be asked.

Nothing here holds a request back: admission does not look at armed retries. A re-issued check is
a new prefetch, so the request waits for it as for its first one (by the stop policy).

TP: every input is the same on every rank (agreed verdicts, the pass count, the queue order), so
every rank re-issues the same checks at the same pass; no collective here.
"""

from __future__ import annotations

from typing import Iterable

from sglang.srt.mem_cache.controller.storage_settings import PrefetchRetrySettings


class StoragePrefetchRetries:
    """Armed retries (request id -> the pass they are due at, None until a pass saw them) and
    the re-issues each queued request made. Scheduler thread only."""

    def __init__(self, settings: PrefetchRetrySettings | None = None):
        self.settings = settings or PrefetchRetrySettings()
        self._due: dict[str, int | None] = {}
        self._attempts: dict[str, int] = {}
        self._pass = 0

    def poll_miss(self, req_id: str) -> None:
        """Arm a paced retry for ``req_id`` (its agreed check was a miss). No-op when retries are
        off or the request used its re-issues."""
        if self.settings.enabled and self.attempts(req_id) < self.settings.max_attempts:
            self._due[req_id] = None

    def attempts(self, req_id: str) -> int:
        """Checks re-issued for ``req_id`` so far."""
        return self._attempts.get(req_id, 0)

    def is_armed(self, req_id: str) -> bool:
        return req_id in self._due

    def forget(self, req_id: str) -> None:
        """``req_id`` left the queue (admitted or aborted): drop its retry and its count."""
        self._due.pop(req_id, None)
        self._attempts.pop(req_id, None)

    def clear(self) -> None:
        self._due.clear()
        self._attempts.clear()

    def tracked(self) -> int:
        """Requests with an armed retry or a re-issue count (0 when nothing waits)."""
        return len(self._due.keys() | self._attempts.keys())

    def pop_ready(self, queue_rids: Iterable[str]) -> list[str]:
        """One scheduling pass: the ids of ``queue_rids`` (the waiting queue, head first) whose
        retry is due, in queue order, each counted as a re-issue and disarmed; the caller
        issues their checks. Drops the head's retry."""
        self._pass += 1
        if not self._due:
            return []
        rids = iter(queue_rids)
        head = next(rids, None)
        self._due.pop(head, None)
        ready = []
        for rid in rids:
            if rid not in self._due:
                continue
            due = self._due[rid]
            if due is None:
                due = self._due[rid] = self._pass + self.settings.poll_interval
            if due <= self._pass:
                del self._due[rid]
                self._attempts[rid] = self.attempts(rid) + 1
                ready.append(rid)
        return ready
