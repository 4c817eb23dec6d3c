"""KV cache events: what a KV-aware router learns about the tree's pages (upstream's records).

``BlockStored`` (pages that became available in a tier), ``BlockRemoved`` (pages that left
it) and ``AllBlocksCleared`` (the tree was reset) carry upstream's field names and meaning; a
block is one page, named by its page hash as a signed 64-bit int (the first 16 hex digits of
the tree's SHA-256 page hash). The records live here, beside the tree that emits them (the
cache layer may not import ``disaggregation``); ``disaggregation.kv_events``, where upstream
keeps them, publishes them and is where callers import them from.

A tree with events on holds a ``KVCacheEventRecorder``; with events off it holds None, and
every place that would record tests that one attribute (nothing else runs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "KVCacheEventRecorder",
    "StorageMedium",
    "hash_str_to_int64",
]


class StorageMedium(str, enum.Enum):
    """The tier an event is about (upstream's values, which go on the wire)."""

    GPU = "GPU"  # L1: the device pool
    CPU = "CPU_PINNED"  # L2: the host pool
    DISK = "DISK"  # L3: storage
    EXTERNAL = "EXTERNAL"


class KVCacheEvent:
    """Base of the event records."""

    __slots__ = ()


@dataclass
class BlockStored(KVCacheEvent):
    """Pages now held in ``medium``: ``block_hashes`` (one per page), ``parent_block_hash`` the
    page before the first one (None at the root), ``token_ids`` their tokens, ``block_size``
    tokens per page. ``lora_id`` / ``cache_salt`` / ``session_id`` / ``lora_name`` are
    upstream's attribution fields; the namespace is already in the hashes."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved(KVCacheEvent):
    """Pages no longer held in ``medium``."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass
class AllBlocksCleared(KVCacheEvent):
    """Every page of every tier is gone (the tree was reset)."""


@dataclass
class EventBatch:
    """What a publisher sends at once: the events of one scheduler step, taken at ``ts``
    (seconds since the epoch); ``attn_dp_rank`` names the cache (the publisher fills it)."""

    ts: float
    events: list
    attn_dp_rank: int | None = None


@dataclass
class KVEventBatch(EventBatch):
    """A batch of KV cache events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``)."""


def hash_str_to_int64(hash_hex: str) -> int:
    """A page hash (hex) as the signed 64-bit block hash events carry: its first 64 bits."""
    value = int(hash_hex[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class KVCacheEventRecorder:
    """Queue of one tree's events, oldest first. ``page_size``: tokens per block."""

    page_size: int
    _queue: list = field(default_factory=list)

    def stored(self, node, medium: StorageMedium = StorageMedium.GPU) -> None:
        """``node``'s pages entered ``medium``: one ``BlockStored`` per page, each chained to
        the page before it (the parent's last page for the first one)."""
        parent = node.parent
        prev = None if parent is None or parent.parent is None else hash_str_to_int64(parent.hash_value[-1])
        ids, P, tier = node.key.ids, self.page_size, medium.value
        for i, h in enumerate(node.hash_value):
            block = hash_str_to_int64(h)
            self._queue.append(BlockStored([block], prev, ids[i * P : (i + 1) * P].tolist(), P, None, medium=tier))
            prev = block

    def removed(self, node, medium: StorageMedium = StorageMedium.GPU) -> None:
        """``node``'s pages left ``medium``: one ``BlockRemoved`` naming all of them."""
        if node.hash_value:
            self._queue.append(BlockRemoved([hash_str_to_int64(h) for h in node.hash_value], medium=medium.value))

    def cleared(self) -> None:
        self._queue.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call; the queue starts empty again."""
        events, self._queue = self._queue, []
        return events
