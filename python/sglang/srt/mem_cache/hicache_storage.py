"""HiCacheStorage: the L3 interface, its configuration and the multi-pool transfer types.

Keys passed to every method are the tree's page hashes (``page_hash.py``: 64 hex digits, one
per page); a backend derives its object names from them (``storage_keys.py``). Host indices are
token slots of the registered host pool (request slots for Mamba): page ``i`` of a batch is the
``page_size`` slots starting at ``host_indices[i * page_size]``.

A miss or a backend fault is a result, never an exception: ``batch_exists`` returns a shorter
prefix, ``batch_get_*`` / ``batch_set_*`` return False for the pages concerned, and the backend
counts it in ``get_stats()``. Bad arguments (a malformed key, misaligned indices) raise
ValueError: they are the caller's bug.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence

import torch

from sglang.srt.mem_cache.cache_init_params import check_parallel_coords
from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, ShardMode
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.controller.storage_settings import parse_extra_config_arg

__all__ = [
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "STORAGE_BATCH_SIZE",
    "StorageBackendError",
    "leading_hits",
]

STORAGE_BATCH_SIZE = 128  # pages per existence query / transfer chunk


class StorageBackendError(RuntimeError):
    """An I/O failure of a storage backend, raised at the adapter boundary (never a raw SDK code).
    ``quiet``: an expected, already-logged condition (an endpoint known to be down), counted and
    treated as a miss without a traceback per call."""

    quiet = False


class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"  # every page of the prefix must exist (KV-derived sidecars, e.g. DSA)
    TRAILING_PAGES = "trailing_pages"  # only the last N pages must exist (Mamba / SWA states)


@dataclass
class PoolTransfer:
    """One pool's part of a multi-pool transfer.

    ``keys``: page hashes, one per page of this pool (for a TRAILING_PAGES pool, the hashes of
    the pages whose state it holds). ``host_indices``: that pool's host slots, ``len(keys) *
    page_size`` of them. ``trailing_pages``: how many last pages a TRAILING_PAGES pool needs.
    ``device_indices`` is carried for the controller and ignored by backends.
    """

    name: PoolName
    host_indices: torch.Tensor | None = None
    keys: list[str] | None = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    trailing_pages: int = 1
    device_indices: Any = None

    def __post_init__(self):
        self.name = PoolName(self.name)
        self.hit_policy = PoolHitPolicy(self.hit_policy)
        if self.trailing_pages < 1:
            raise ValueError(f"trailing_pages must be >= 1, got {self.trailing_pages}")


@dataclass
class PoolTransferResult:
    """Existence over several pools: leading KV pages, and per side pool the longest prefix
    (in KV pages) that pool can serve under its hit policy."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[PoolName, int] = field(default_factory=dict)

    @property
    def hit_pages(self) -> int:
        """The usable prefix: the minimum over the KV pool and every side pool."""
        return min([self.kv_hit_pages, *self.extra_pool_hit_pages.values()])


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: list[str] | None = None  # page hashes of the prefix before the batch
    extra_info: dict | None = None


def leading_hits(flags: Sequence[bool]) -> int:
    """Length of the leading run of True in ``flags``."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


@dataclass(frozen=True)
class HiCacheStorageConfig:
    """What a backend needs to know about this rank. Build it with :meth:`from_cache_params`.

    ``is_mla_model`` means the anchor pool's bytes are replicated across TP ranks (MLA, the
    DeepSeek-V4 anchor): keys omit the TP coordinates and only TP rank 0 writes.
    """

    model_name: str
    kv_dtype: str
    page_size: int
    page_format: str
    is_mla_model: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    namespace_salt: str = ""
    extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        check_parallel_coords(self)
        if not isinstance(self.extra_config, dict):
            raise ValueError(f"extra_config must be a dict, got {type(self.extra_config).__name__}")
        if not isinstance(self.namespace_salt, str):
            raise ValueError(f"namespace_salt must be a string, got {self.namespace_salt!r}")

    @classmethod
    def from_cache_params(cls, params, host_pool, model_name: str, extra_config: str | dict | None = None):
        """The config of this rank: parallel coordinates from ``params`` (a CacheInitParams), the
        page format from ``host_pool`` (a host pool or a HostPoolGroup: its anchor)."""
        anchor = getattr(host_pool, "anchor_pool", host_pool)
        extra = parse_extra_config_arg(extra_config, "extra_config")
        salt = extra.get("namespace_salt", "")
        if not isinstance(salt, str):
            raise ValueError(f"extra config key 'namespace_salt' must be a string, got {salt!r}")
        return cls(
            model_name=model_name,
            kv_dtype=str(anchor.dtype).removeprefix("torch."),
            page_size=anchor.page_size,
            page_format=anchor.page_format,
            is_mla_model=SHARD_MODE[anchor.kind] is ShardMode.REPLICATED,
            tp_rank=params.tp_rank,
            tp_size=params.tp_size,
            pp_rank=params.pp_rank,
            pp_size=params.pp_size,
            attn_cp_rank=params.attn_cp_rank,
            attn_cp_size=params.attn_cp_size,
            namespace_salt=salt,
            extra_config=extra,
        )


class HiCacheStorage(ABC):
    """The L3 tier. Backends are built by ``StorageBackendFactory`` as ``cls(config, host_pool)``.

    Methods may be called concurrently from the controller's prefetch and backup threads.
    """

    @abstractmethod
    def register_mem_pool_host(self, host_pool) -> None:
        """Remember the anchor (KV) host pool; zero-copy backends register its buffers here."""

    def register_mem_host_pool_v2(self, host_pool, name: PoolName) -> None:
        """Register a side pool under ``name`` (the KV pool itself is handled by v1)."""
        raise NotImplementedError(f"{type(self).__name__} does not support side pools")

    @abstractmethod
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading pages of ``keys`` stored (every object of each page present)."""

    @abstractmethod
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Read page i into the host slots starting at ``host_indices[i * page_size]``.

        Mutates only those host slots. Returns one flag per page; False = miss (nothing usable
        was loaded for that page)."""

    @abstractmethod
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``; one success flag per page."""

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info=None):
        """Existence over the KV pool and ``pool_transfers``' pools -> PoolTransferResult."""
        if pool_transfers:
            raise NotImplementedError(f"{type(self).__name__} does not support side pools")
        return PoolTransferResult(self.batch_exists(keys, extra_info))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        raise NotImplementedError(f"{type(self).__name__} does not support side pools")

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        raise NotImplementedError(f"{type(self).__name__} does not support side pools")

    def clear(self) -> None:
        """Delete what this backend stored (best effort)."""

    def get_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Release resources; idempotent. Later calls return misses."""
