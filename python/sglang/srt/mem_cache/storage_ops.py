"""The two L2<->L3 operations: a prefetch (storage -> host) and a backup (host -> storage).

Fields the scheduler thread owns are written only there (state, agreed counts, host slots,
``cancel``); fields a storage thread owns are written only there (``local_hit_pages``,
``query_done``, ``completed_pages``, ``io_done``, ``failed``). Each is a plain attribute read
across threads (single assignments, so a reader sees the old or the new value).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch


class PrefetchState(Enum):
    QUERYING = "querying"  # existence check queued or running; hit count not agreed yet
    LOADING = "loading"  # host slots reserved, pages being read
    FINISHED = "finished"  # nothing (more) will be read: below threshold, host full, or read done


@dataclass(eq=False)
class PrefetchOperation:
    """Pages ``keys`` (page hashes of ``tokens``, chained from ``last_node``) for ``request_id``.

    ``tokens``: the page-aligned token ids after ``last_node``; ``keys[i]`` names page i.
    ``hit_pages``: agreed leading pages found in storage (0 until agreed). ``host_indices``:
    host token slots reserved for them (``hit_pages * page_size``); ``held``: the part of those
    not yet handed to the tree or freed (reported to the integrity check).
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
    held: torch.Tensor | None = None
    terminated: bool = False
    cancel: bool = False
    # written by the storage threads
    local_hit_pages: int = 0
    query_done: bool = False
    completed_pages: int = 0
    io_done: bool = False
    failed: bool = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start_time


@dataclass(eq=False)
class BackupOperation:
    """Store the pages ``keys`` held in host slots ``host_indices`` (page i at
    ``host_indices[i * page_size]``); ``node``'s host copy is pinned until the ack."""

    node: object
    keys: list[str]
    host_indices: torch.Tensor
    done: bool = False
    failed: bool = False
