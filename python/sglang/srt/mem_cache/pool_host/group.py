"""HostPoolGroup: one anchor pool (the slots the tree tracks) and named side pools.

Side pools are either *sidecars* addressed with the anchor's slots (DSA indexer, V4 state) or
pools with slots of their own (Mamba: one per request). The group is a facade; the hybrid
controllers decide which side-pool indices go with which anchor pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
    name: PoolName
    host_pool: HostKVCache
    device_pool: KVCache
    shares_anchor_slots: bool = False


class HostPoolGroup:
    def __init__(self, anchor: PoolEntry, side_pools: list[PoolEntry] = ()):
        self.anchor = anchor
        self.entries: dict[PoolName, PoolEntry] = {anchor.name: anchor}
        for entry in side_pools:
            if entry.name in self.entries:
                raise ValueError(f"pool {entry.name.value!r} is registered twice")
            if entry.shares_anchor_slots:
                host = entry.host_pool
                if (host.size, host.page_size) != (anchor.host_pool.size, anchor.host_pool.page_size):
                    raise ValueError(
                        f"sidecar {entry.name.value!r} has {host.size} slots / page {host.page_size}; "
                        f"the anchor has {anchor.host_pool.size} / {anchor.host_pool.page_size}"
                    )
            self.entries[entry.name] = entry

    @property
    def anchor_pool(self) -> HostKVCache:
        return self.anchor.host_pool

    @property
    def layout(self):
        return self.anchor_pool.layout

    @property
    def page_size(self) -> int:
        return self.anchor_pool.page_size

    @property
    def size(self) -> int:
        return self.anchor_pool.size

    def names(self) -> list[PoolName]:
        return list(self.entries)

    def entry(self, name: PoolName) -> PoolEntry:
        try:
            return self.entries[PoolName(name)]
        except (KeyError, ValueError):
            raise KeyError(f"no pool {name!r} in this group; has {[n.value for n in self.entries]}") from None

    def sidecars(self) -> list[PoolEntry]:
        """Side pools addressed with the anchor's slots."""
        return [e for e in self.entries.values() if e.shares_anchor_slots]

    def _allocating(self, pool: PoolName) -> HostKVCache:
        entry = self.entry(pool)
        if entry.shares_anchor_slots:
            raise ValueError(f"pool {entry.name.value!r} uses the anchor's slots; allocate from {self.anchor.name.value!r}")
        return entry.host_pool

    def alloc(self, need_size: int, pool: PoolName = PoolName.KV) -> torch.Tensor | None:
        """Allocate slots from ``pool`` (the anchor by default); None when full."""
        return self._allocating(pool).alloc(need_size)

    def free(self, indices, pool: PoolName = PoolName.KV) -> int:
        return self._allocating(pool).free(indices)

    def available_size(self, pool: PoolName = PoolName.KV) -> int:
        return self._allocating(pool).available_size()

    def get_size_per_token(self) -> int:
        """Bytes per anchor slot over the anchor and its sidecars."""
        return self.anchor_pool.get_size_per_token() + sum(e.host_pool.get_size_per_token() for e in self.sidecars())

    def is_stride_page_aligned(self, alignment: int = 4096) -> bool:
        """AND over every pool of the group."""
        return all(e.host_pool.is_stride_page_aligned(alignment) for e in self.entries.values())

    def backup_anchor_pages(self, host_indices, device_indices) -> None:
        """Device -> host, all layers, for the anchor and every sidecar (same slots)."""
        for entry in [self.anchor, *self.sidecars()]:
            entry.host_pool.backup_from_device_all_layer(entry.device_pool, host_indices, device_indices)

    def load_anchor_pages_per_layer(self, host_indices, device_indices, layer_id: int) -> None:
        """Host -> device for layer ``layer_id`` of the anchor and of each sidecar that has it."""
        for entry in [self.anchor, *self.sidecars()]:
            if layer_id < entry.host_pool.layer_num:
                entry.host_pool.load_to_device_per_layer(entry.device_pool, host_indices, device_indices, layer_id)
