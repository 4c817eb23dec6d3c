"""The two L2<->L3 operations: a prefetch (storage -> host) and a backup (host -> storage;
upstream's ``StorageOperation``).

Fields the scheduler thread owns are written only there (state, agreed counts, host slots,
``cancel``); fields a storage thread owns are written only there (``local_hit_pages``,
``query_done``, ``completed_pages``, ``state_ok``, ``io_done``, ``failed``). Each is a plain
attribute read across threads (single assignments, so a reader sees the old or the new value).

Trailing state (Mamba): a prefix is usable only with the state after its last page, so a
prefetch of a state-carrying stack reserves one state slot, reads the state after its KV pages
and counts as arrived only when every page and the state did (``usable_pages``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from sglang.srt.mem_cache.pool_host.group import PoolName


class PrefetchState(Enum):
    QUERYING = "querying"  # existence check queued or running; hit count not agreed yet
    LOADING = "loading"  # host slots reserved, pages being read
    FINISHED = "finished"  # nothing (more) will be read: below threshold, host full, or read done


@dataclass(eq=False)
class PrefetchOperation:
    """Pages ``keys`` (page hashes of ``tokens``, chained from ``last_node``) for ``request_id``.

    ``tokens``: the page-aligned token ids after ``last_node``; ``keys[i]`` names page i.
    ``hit_pages``: agreed leading pages found in storage (0 until agreed); with a state pool,
    the longest prefix whose trailing state was found. ``host_indices``: host token slots
    reserved for them (``hit_pages * page_size``); ``state_host``: the one state slot reserved
    for the state after page ``hit_pages - 1`` (None without a state pool). ``held`` /
    ``state_held``: the parts not yet handed to the tree or freed (reported to the integrity
    check).
    """

    request_id: str
    last_node: object
    tokens: list[int]
    keys: list[str]
    extra_key: str | None
    start_time: float = field(default_factory=time.monotonic)
    state: PrefetchState = PrefetchState.QUERYING
    hit_pages: int = 0
    host_indices: torch.Tensor | None = None
    state_host: torch.Tensor | None = None
    held: torch.Tensor | None = None
    state_held: torch.Tensor | None = None
    terminated: bool = False
    cancel: bool = False
    # written by the storage threads
    local_hit_pages: int = 0
    query_done: bool = False
    completed_pages: int = 0
    state_ok: bool = False
    io_done: bool = False
    failed: bool = False
    unsettled: bool = False  # it failed while the backend may still write its slots

    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    def usable_pages(self) -> int:
        """Leading pages this rank can hand to the tree now: the pages read so far; with a
        state pool, all ``hit_pages`` once they and their state arrived, else 0."""
        if self.state is not PrefetchState.LOADING:
            return 0
        if self.state_host is None:
            return self.completed_pages
        return self.hit_pages if self.completed_pages == self.hit_pages and self.state_ok else 0


@dataclass(eq=False)
class StorageOperation:
    """A backup (upstream's name for it): store the pages ``keys`` held in host slots ``host_indices`` (page i at
    ``host_indices[i * page_size]``); ``node``'s host copy is pinned until the ack.

    ``states``: (page index i, state host slot) for each trailing state to store with the
    pages, under ``keys[i]`` (the state after page i)."""

    node: object
    keys: list[str]
    host_indices: torch.Tensor
    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    done: bool = False
    failed: bool = False


@dataclass(eq=False)
class Quarantine:
    """Host slots of backups abandoned by a bounded flush: a storage thread may still read
    them, so they are neither in the tree nor free until every op in ``ops`` is done."""

    ops: list[StorageOperation]
    slots: dict[PoolName, torch.Tensor]

    def released(self) -> bool:
        return all(op.done for op in self.ops)


class HiCacheFlushIncomplete(RuntimeError):
    """``reset`` gave up waiting for storage operations (``flush_timeout_s``).

    The tree is empty and usable; the abandoned operations' host slots stay held (quarantined,
    counted by ``check_integrity``) until their storage threads return. ``pending`` counts them
    by kind (``backups``, ``reads``, ``queries``) on this rank."""

    def __init__(self, timeout_s: float, pending: dict[str, int]):
        self.timeout_s = timeout_s
        self.pending = dict(pending)
        what = ", ".join(f"{n} {kind}" for kind, n in pending.items() if n) or "operations on another TP rank"
        super().__init__(
            f"flush incomplete: storage {what} still running after {timeout_s:g} s; the cache is "
            "empty, their host slots stay quarantined until the storage backend returns"
        )
