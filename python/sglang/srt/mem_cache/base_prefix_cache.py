"""The prefix-cache interface (upstream's): what ``match_prefix``, ``insert`` and ``evict`` take
and return, and the base class every radix tree derives from.

Calls take one parameter record and return one result record, as upstream's do:
``tree.match_prefix(MatchPrefixParams(key=...))``, ``tree.insert(InsertParams(key=..., value=...))``
(an ``InsertResult``), ``tree.evict(EvictParams(num_tokens=...))`` (an ``EvictResult``). The
records carry only the fields our trees honour (a field no tree reads is refused as an unknown
keyword, never silently ignored); ``InsertParams.chunked`` is ours.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.mem_cache.radix.tree_node import empty_indices

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix.radix_key import RadixKey
    from sglang.srt.mem_cache.radix.tree_node import TreeNode


@dataclass
class MatchPrefixParams:
    """``key``: the prefix to look up (only whole pages of it can match)."""

    key: RadixKey


@dataclass
class InsertParams:
    """``key``: the tokens to cache (whole pages; a trailing partial page is not inserted).
    ``value``: one device slot per token of ``key`` (``RadixCache.create_simulated`` trees
    also take None: the token ids stand in). ``mamba_value``: hybrid trees, the device Mamba
    slot holding the state after ``key``. ``chunked`` (ours): the insert of a chunked prefill,
    which does not count as a hit towards write-through. ``priority``: the request's priority
    (None: 0); every node on the path keeps the highest one inserted through it, which the
    ``priority`` eviction policy evicts lowest first."""

    key: RadixKey | None = None
    value: torch.Tensor | None = None
    mamba_value: torch.Tensor | None = None
    chunked: bool = False
    priority: int | None = 0


def request_priority(req) -> int:
    """The priority a request's inserts carry (0 for a request without one)."""
    return getattr(req, "priority", None) or 0


@dataclass
class InsertResult:
    """``prefix_len``: leading tokens the tree already held on device. The caller still owns
    ``value[:prefix_len]`` (duplicates: it frees them) and any unaligned tail past the whole
    pages; the rest now belongs to the tree."""

    prefix_len: int


@dataclass
class EvictParams:
    """How much to free: ``num_tokens`` device token slots, ``mamba_num`` device Mamba states
    (hybrid trees). ValueError for a negative count."""

    num_tokens: int = 0
    mamba_num: int = 0

    def __post_init__(self):
        if self.num_tokens < 0 or self.mamba_num < 0:
            raise ValueError(
                f"EvictParams counts must be >= 0, got num_tokens={self.num_tokens}, mamba_num={self.mamba_num}"
            )


@dataclass
class EvictResult:
    """What an eviction freed (may fall short of what was asked when too little is evictable)."""

    num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: device token slots of the matched prefix that is on device (int64, CPU).
    ``last_device_node``: deepest matched node with a device copy (the root on a miss).
    ``last_host_node``: deepest matched node (device or host copy); equals ``last_device_node``
    when nothing matched only on host. ``host_hit_length``: tokens between the two (host only).
    ``path`` (ours): every node the match walked, root excluded (hybrid trees may stop short of
    its end); ``match_reuse`` checks it to reuse a match across steps.
    """

    device_indices: torch.Tensor = field(default_factory=empty_indices)
    last_device_node: TreeNode | None = None
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0
    path: tuple = ()

    @property
    def prefix_len(self) -> int:
        """Tokens matched on device (``len(device_indices)``)."""
        return self.device_indices.shape[0]


class BasePrefixCache(ABC):
    """What the scheduler needs of a prefix cache.

    ``kv_events``: the cache's KV event recorder (``radix/event_recorder.py``), None when
    events are off; ``take_events`` drains it.
    """

    kv_events: Any = None
    cache_controller: Any = None

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult: ...

    @abstractmethod
    def insert(self, params: InsertParams) -> InsertResult: ...

    @abstractmethod
    def evict(self, params: EvictParams) -> EvictResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def cache_finished_req(self, req, is_insert: bool = True) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req, chunked: bool = False) -> None: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    def take_events(self) -> list:
        """The KV events recorded since the last call, oldest first (empty when events are off)."""
        return [] if self.kv_events is None else self.kv_events.take()

    def pretty_print(self) -> None:
        raise NotImplementedError

    def supports_mamba(self) -> bool:
        """Whether the tree keeps Mamba states with its prefixes (``InsertParams.mamba_value``,
        ``EvictParams.mamba_num``)."""
        return False

    def available_and_evictable_str(self) -> str:
        """One log line: free device slots plus what eviction could free."""
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.evictable_size()
        return f"Available tokens: {available + evictable} ({available=} + {evictable=})\n"
