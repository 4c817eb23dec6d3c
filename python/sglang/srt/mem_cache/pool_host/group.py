"""HostPoolGroup: one anchor pool (the slots the tree tracks) and named side pools.

Side pools are either *sidecars* addressed with the anchor's slots (DSA indexer, V4 state) or
pools with slots of their own (Mamba: one per request). The group is a facade; the hybrid
controllers decide which side-pool indices go with which anchor pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class PoolName(str, Enum):
    KV = "kv"
    MAMBA = "mamba"
    INDEXER = "indexer"
    DSV4_STATE = "dsv4_state"
    SWA = "swa"  # upstream's sliding-window side pool (a pool name storage backends key by)


@dataclass
class PoolEntry:
    """One pool of a group (upstream's fields first). ``layer_mapper`` is upstream's map from a
    transfer layer id to the pool's layer; ours is not consulted: every pool's layers are
    pool-local and a load moves layer ``l`` of each pool that has it. ``shares_anchor_slots``
    (ours): a sidecar, addressed with the anchor's slots and never allocated from on its own."""

    name: PoolName
    host_pool: HostKVCache
    device_pool: KVCache
    layer_mapper: Callable[[int], int | None] | None = None
    is_primary_index_anchor: bool = False
    shares_anchor_slots: bool = False


class HostPoolGroup:
    """Upstream's constructor: ``entries`` in order; the one marked ``is_primary_index_anchor``
    (else the first) is the anchor. A sidecar must have the anchor's size and page size."""

    def __init__(self, entries: list[PoolEntry]):
        if not entries:
            raise ValueError("HostPoolGroup requires at least one pool entry")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"HostPoolGroup pool names must be unique, got {[PoolName(n).value for n in names]}")
        anchors = [e for e in entries if e.is_primary_index_anchor]
        if len(anchors) > 1:
            raise ValueError(f"HostPoolGroup takes at most one anchor, got {[e.name.value for e in anchors]}")
        self.anchor_entry = anchors[0] if anchors else entries[0]
        if self.anchor_entry.shares_anchor_slots:
            raise ValueError(f"the anchor {self.anchor_entry.name.value!r} cannot share another pool's slots")
        anchor = self.anchor_entry.host_pool
        for entry in entries:
            host = entry.host_pool
            if entry.shares_anchor_slots and (host.size, host.page_size) != (anchor.size, anchor.page_size):
                raise ValueError(
                    f"sidecar {entry.name.value!r} has {host.size} slots / page {host.page_size}; "
                    f"the anchor has {anchor.size} / {anchor.page_size}"
                )
        self.entries = list(entries)
        self.entry_map = {e.name: e for e in entries}

    @property
    def anchor_pool(self) -> HostKVCache:
        return self.anchor_entry.host_pool

    @property
    def layout(self):
        return self.anchor_pool.layout

    @property
    def page_size(self) -> int:
        return self.anchor_pool.page_size

    @property
    def size(self) -> int:
        return self.anchor_pool.size

    def get_entry(self, name: PoolName | None = None) -> PoolEntry:
        """The entry of pool ``name`` (the anchor's for None); KeyError naming the pools."""
        if name is None:
            return self.anchor_entry
        try:
            return self.entry_map[PoolName(name)]
        except (KeyError, ValueError):
            label = name.value if isinstance(name, PoolName) else name
            raise KeyError(f"no pool {label!r} in this group; has {[n.value for n in self.entry_map]}") from None

    def get_pool(self, name: PoolName | None = None) -> HostKVCache:
        return self.get_entry(name).host_pool

    def sidecars(self) -> list[PoolEntry]:
        """Side pools addressed with the anchor's slots."""
        return [e for e in self.entries if e.shares_anchor_slots]

    def _allocating(self, pool: PoolName | None) -> HostKVCache:
        entry = self.get_entry(pool)
        if entry.shares_anchor_slots:
            raise ValueError(
                f"pool {entry.name.value!r} uses the anchor's slots; allocate from {self.anchor_entry.name.value!r}"
            )
        return entry.host_pool

    def alloc(self, need_size: int, *, pool: PoolName | None = None) -> torch.Tensor | None:
        """Allocate slots from ``pool`` (the anchor by default); None when full."""
        return self._allocating(pool).alloc(need_size)

    def free(self, indices, *, pool: PoolName | None = None) -> int:
        return self._allocating(pool).free(indices)

    def available_size(self, pool: PoolName | None = None) -> int:
        return self._allocating(pool).available_size()

    def clear(self) -> None:
        for entry in self.entries:
            entry.host_pool.clear()

    def destroy(self) -> None:
        for entry in self.entries:
            entry.host_pool.destroy()

    def get_size_per_token(self) -> int:
        """Bytes per anchor slot over the anchor and its sidecars."""
        return self.anchor_pool.get_size_per_token() + sum(e.host_pool.get_size_per_token() for e in self.sidecars())

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """AND over every pool of the group."""
        return all(e.host_pool.is_stride_page_aligned(page_size_bytes) for e in self.entries)
