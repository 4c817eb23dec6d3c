"""HiCacheStorage: the L3 interface, its configuration, the multi-pool transfer types, the paged
engine every built-in backend shares (:class:`PagedStorage`) and the embedded file backend
(:class:`HiCacheFile`), as upstream places them.

Keys passed to every method are normally the tree's page hashes (``radix/page_hash.py``: 64 hex
digits, one per page); any non-empty string is accepted. A backend derives its object names from
them (``storage/keys.py``), so no key reaches a path. Host indices are token slots of the
registered host pool (request slots for Mamba): page ``i`` of a batch is the ``page_size`` slots
starting at ``host_indices[i * page_size]``; in span mode (``storage_page_size``) one key covers
``storage_page_size / page_size`` host pages of a token pool.

A miss or a backend fault is a result, never an exception: ``batch_exists`` returns a shorter
prefix, ``batch_get_*`` / ``batch_set_*`` return False for the pages concerned, and the backend
counts it in ``get_stats()``. Bad arguments to v1 (a key that is not a string, misaligned
indices) raise ValueError: they are the caller's bug; in v2 they fail only their pool's transfer.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence

import torch

from sglang.srt.mem_cache.cache_init_params import check_parallel_coords
from sglang.srt.mem_cache.controller.storage_settings import parse_extra_config_arg
from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, ShardMode
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.file.page_files import OBJECT_FORMAT as FILE_OBJECT_FORMAT
from sglang.srt.mem_cache.storage.file.page_files import PageFiles, parse_file_options
from sglang.srt.mem_cache.storage.keys import StorageNamespace, check_key
from sglang.srt.mem_cache.storage.pool_codec import PageIO, PoolCodec
from sglang.srt.mem_cache.storage.pool_shape import pool_shape
from sglang.srt.mem_cache.storage.stats import StorageStats

__all__ = [
    "HiCacheFile",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "PagedStorage",
    "STORAGE_BATCH_SIZE",
    "StorageBackendError",
    "leading_hits",
]

logger = logging.getLogger(__name__)

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


_UNSUPPORTED = {  # upstream keywords this fork accepts only at their neutral value
    "should_split_heads": (False, "splitting heads across a TP-lcm group"),
    "dcp_size": (1, "decode context parallelism"),
    "dcp_rank": (0, "decode context parallelism"),
}


@dataclass(frozen=True)
class HiCacheStorageConfig:
    """What a backend needs to know about this rank, with upstream's keywords. Controllers build
    it with :meth:`from_cache_params`; a test or an upstream-style caller may construct it
    directly: only ``model_name`` is required.

    ``is_mla_model`` means the anchor pool's bytes are replicated across TP ranks (MLA, the
    DeepSeek-V4 anchor): keys omit the TP coordinates and only TP rank 0 writes. The page format
    (``kv_dtype``, ``page_size``, ``page_format``) is derived from each pool when it registers;
    when given here it is checked against the KV pool. ``storage_page_size``: tokens one key
    covers (span mode); default the KV pool's page size. ``enable_storage_metrics`` and
    ``is_page_first_layout`` are carried for callers; backends derive the layout from the pool.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None
    storage_page_size: int | None = None
    kv_dtype: str | None = None
    page_size: int | None = None
    page_format: str | None = None

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        check_parallel_coords(self)
        for name in ("is_mla_model", "enable_storage_metrics", "is_page_first_layout"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.dp_rank, int) or self.dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {self.dp_rank!r}")
        for name, (neutral, what) in _UNSUPPORTED.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}={getattr(self, name)!r}: {what} is not supported by this fork's storage; "
                                 f"allowed: {neutral!r}")
        if self.tp_lcm_size not in (None, self.tp_size):
            raise ValueError(f"tp_lcm_size={self.tp_lcm_size!r}: heterogeneous-TP storage is not supported; "
                             f"allowed: None or tp_size ({self.tp_size})")
        for name in ("logical_page_size", "storage_page_size", "page_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        for name in ("kv_dtype", "page_format"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be None or a string, got {getattr(self, name)!r}")
        if self.extra_config is None:
            object.__setattr__(self, "extra_config", {})
        if not isinstance(self.extra_config, dict):
            raise ValueError(f"extra_config must be a dict, got {type(self.extra_config).__name__}")
        for name in ("namespace_salt", "extra_backend_tag"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"extra config key {name!r} must be a string, got {getattr(self, name)!r}")

    @property
    def namespace_salt(self) -> str:
        """Extra config ``namespace_salt``: isolates deployments sharing one store."""
        return self.extra_config.get("namespace_salt", "")

    @property
    def extra_backend_tag(self) -> str:
        """Extra config ``extra_backend_tag`` (upstream's tenant tag): a part of the storage
        namespace, so servers with different tags never read each other's pages."""
        return self.extra_config.get("extra_backend_tag", "")

    @property
    def is_storage_writer(self) -> bool:
        """Whether this rank writes the anchor pool: every rank, or TP rank 0 of an MLA model."""
        return not self.is_mla_model or self.tp_rank == 0

    @classmethod
    def from_cache_params(cls, params, host_pool, model_name: str, extra_config: str | dict | None = None,
                          storage_page_size: int | None = None, enable_storage_metrics: bool = False):
        """The config of this rank: parallel coordinates from ``params`` (a CacheInitParams), the
        page format from ``host_pool`` (a host pool or a HostPoolGroup: its anchor)."""
        anchor = getattr(host_pool, "anchor_pool", host_pool)
        extra = parse_extra_config_arg(extra_config, "extra_config")
        return cls(
            tp_rank=params.tp_rank,
            tp_size=params.tp_size,
            pp_rank=params.pp_rank,
            pp_size=params.pp_size,
            attn_cp_rank=params.attn_cp_rank,
            attn_cp_size=params.attn_cp_size,
            is_mla_model=SHARD_MODE[anchor.kind] is ShardMode.REPLICATED,
            enable_storage_metrics=enable_storage_metrics,
            is_page_first_layout=anchor.layout.value in ("page_first", "page_first_direct"),
            model_name=model_name,
            extra_config=extra,
            storage_page_size=storage_page_size,
            kv_dtype=str(anchor.dtype).removeprefix("torch."),
            page_size=anchor.page_size,
            page_format=anchor.page_format,
        )


class HiCacheStorage(ABC):
    """The L3 tier. ``StorageBackendFactory`` builds a backend as ``cls(storage_config)`` and then
    registers the host pool (``register_mem_pool_host``).

    Methods may be called concurrently from the controller's prefetch and backup threads.
    """

    @abstractmethod
    def register_mem_pool_host(self, host_pool) -> None:
        """Remember the anchor (KV) host pool; zero-copy backends register its buffers here."""

    def register_mem_host_pool_v2(self, host_pool, name: PoolName) -> None:
        """Register a pool under ``name`` for the v2 API."""
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

    def host_writes_settled(self) -> bool:
        """False while a read that already answered a miss may still write the host slots it
        targeted (a timed-out zero-copy transfer the plugin cannot cancel). The controller keeps
        the slots of a failed read until this is True again, so they are never handed to another
        page while a late transfer can still land in them."""
        return True

    def clear(self) -> None:
        """Delete what this backend stored (best effort)."""

    def get_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Release resources; idempotent. Later calls return misses."""


def trailing_hit(flags: list[bool], n: int) -> int:
    """Largest L <= len(flags) with flags[L-n:L] all True (a state usable at prefix L), else 0."""
    for end in range(len(flags), n - 1, -1):
        if all(flags[end - n : end]):
            return end
    return 0


class PagedStorage(HiCacheStorage):
    """The v1/v2 API over a backend's three object primitives.

    A backend subclass provides ``_exists_objects`` (which names are stored), ``_read_pages``
    and ``_write_pages`` (move pages, verify integrity, one flag per page). This class owns
    everything else, identically for every backend: pool registration and keys, argument
    validation, span mode, hit policies, the MLA backup skip, counters, and the fault guard that
    turns any backend exception into a counted failure and a miss."""

    object_format: str  # the framing of a stored object; part of every key namespace
    per_component: bool  # one object per component (True) or per flat page (False)
    grouped_names = False  # object names carry the page group (see PoolCodec)

    def __init__(self, storage_config: HiCacheStorageConfig):
        self.config = storage_config
        self.stats = StorageStats()
        self.codecs: dict[PoolName, PoolCodec] = {}
        self.backup_skip = not storage_config.is_storage_writer
        self.is_mla_model = storage_config.is_mla_model
        self._closed = False
        self._close_lock = threading.Lock()
        self._register_lock = threading.Lock()

    # ---- registration -------------------------------------------------------------------
    def register_mem_pool_host(self, host_pool) -> None:
        """Register the anchor pool (a HostPoolGroup registers its side pools too)."""
        anchor = getattr(host_pool, "anchor_pool", host_pool)
        self._register(PoolName.KV, anchor, spans=True)
        entries = getattr(host_pool, "entries", ())
        for entry in entries.values() if isinstance(entries, dict) else entries:
            if entry.host_pool is not anchor:
                self._register(PoolName(entry.name), entry.host_pool, spans=entry.shares_anchor_slots)

    def register_mem_host_pool_v2(self, host_pool, name: PoolName) -> None:
        """Register ``host_pool`` under ``name`` (``PoolName.KV`` too, as upstream allows). In
        span mode a pool of token pages (page_size > 1, or the KV pool) covers several pages per
        key; a pool of one slot per page (a Mamba state) keeps one slot per key."""
        name = PoolName(name)
        self._register(name, host_pool, spans=name is PoolName.KV or getattr(host_pool, "page_size", 1) > 1)

    def _register(self, name: PoolName, host_pool, spans: bool) -> None:
        with self._register_lock:
            known = self.codecs.get(name)
            if known is not None:
                if known.host_pool is not host_pool:
                    raise ValueError(f"pool {name.value!r} is already registered with another host pool")
                return
            shape = pool_shape(host_pool, name, self.config.is_mla_model)
            if name is PoolName.KV:
                self._check_expected(shape)
            pages_per_key = self._pages_per_key(name, shape.page_size) if spans else 1
            namespace = StorageNamespace.for_pool(self.config, host_pool, name.value, self.object_format,
                                                  shard=shape.shard, page_format=shape.page_format,
                                                  kv_dtype=shape.kv_dtype, pages_per_key=pages_per_key)
            codec = PoolCodec(name, host_pool, namespace, self.per_component, self.grouped_names, pages_per_key,
                              shape)
            self._on_register(codec)
            self.codecs[name] = codec
        logger.info("%s: registered pool %s (%d objects per key, %d host pages per key, %s)", type(self).__name__,
                    name.value, len(codec.segments), pages_per_key, "staged" if shape.staged else "in place")

    def _check_expected(self, shape) -> None:
        """The KV pool against what the config says of it (when it says anything)."""
        for field_name, actual in (("page_format", shape.page_format), ("kv_dtype", shape.kv_dtype),
                                   ("page_size", shape.page_size)):
            expected = getattr(self.config, field_name)
            if expected is not None and expected != actual:
                raise ValueError(f"host pool {field_name} {actual!r} differs from the storage config's {expected!r}; "
                                 f"build the config from this pool (or leave {field_name} unset)")

    def _pages_per_key(self, name: PoolName, page_size: int) -> int:
        span = self.config.storage_page_size
        if span is None or span == page_size:
            return 1
        if span % page_size:
            raise ValueError(f"storage_page_size {span} is not a multiple of pool {name.value!r}'s page_size "
                             f"{page_size}; allowed: multiples of {page_size}")
        return span // page_size

    def _on_register(self, codec: PoolCodec) -> None:
        """Hook: prepare backend state for a newly registered pool (e.g. NIXL registration)."""

    def codec(self, name: PoolName) -> PoolCodec:
        try:
            return self.codecs[PoolName(name)]
        except KeyError:
            raise ValueError(f"pool {PoolName(name).value!r} is not registered; registered: "
                             f"{[n.value for n in self.codecs]}") from None

    # ---- backend primitives -------------------------------------------------------------
    @abstractmethod
    def _exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
        """One flag per object name: stored (and, where cheap, of the right size)."""

    @abstractmethod
    def _read_pages(self, pages: list[PageIO]) -> list[bool]:
        """Load and verify every object of each page. A False page leaves no unverified byte in
        host memory (slots of an absent page are untouched; a failed one is zeroed)."""

    @abstractmethod
    def _write_pages(self, pages: list[PageIO]) -> list[bool]:
        """Store every object of each page atomically (a reader sees old or new, never a mix)."""

    def _close(self) -> None:
        """Hook: release backend resources (called once)."""

    # ---- guard --------------------------------------------------------------------------
    def _guard(self, what: str, fn, default):
        if self._closed:
            return default
        try:
            return fn()
        except Exception as exc:  # a backend fault is a miss and a counted failure, never a crash
            if isinstance(exc, StorageBackendError) and exc.quiet:
                # an unavailable endpoint: logged once where it was detected, then a miss per call
                self.stats.add(failures=1, timeouts=1)
                logger.debug("%s: %s missed: %s", type(self).__name__, what, exc)
                return default
            self.stats.add(failures=1)
            logger.warning("%s: %s failed; treated as a miss", type(self).__name__, what, exc_info=True)
            return default

    # ---- v1 -----------------------------------------------------------------------------
    def _page_hits(self, codec: PoolCodec, keys: list[str]) -> list[bool]:
        """Per page: are all its objects stored? Stops after the first chunk with a miss."""
        flags: list[bool] = []
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            names = [codec.object_names(k) for k in keys[start : start + STORAGE_BATCH_SIZE]]
            found = iter(self._exists_objects(codec, [n for page in names for n in page]))
            chunk = [all([next(found) for _ in page]) for page in names]
            flags.extend(chunk)
            if not all(chunk):
                break
        return flags

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        codec = self.codec(PoolName.KV)
        for key in keys:
            check_key(key)  # validate before any I/O
        return self._guard("exists", lambda: leading_hits(self._page_hits(codec, keys)), 0)

    def _moved(self, pages: list[PageIO], flags: list[bool], write: bool) -> list[bool]:
        ok = sum(flags)
        moved = sum(p.nbytes for p, f in zip(pages, flags) if f)
        if write:
            self.stats.add(pages_written=ok, bytes_written=moved)
        else:
            self.stats.add(pages_hit=ok, pages_missed=len(flags) - ok, bytes_read=moved)
        return flags

    def _get(self, pages: list[PageIO]) -> list[bool]:
        if not pages or self._closed:
            return self._moved(pages, [False] * len(pages), write=False)
        flags = self._guard("get", lambda: list(self._read_pages(pages)), None)
        if flags is None:  # the backend raised midway: wipe what it may have half-written
            flags = [False] * len(pages)
            for page in pages:
                page.zero()
        for page, ok in zip(pages, flags):
            if ok:
                page.commit()  # staged pools: the verified copy into the pool
        return self._moved(pages, flags, write=False)

    def _set(self, pages: list[PageIO]) -> list[bool]:
        if not pages:
            return []
        flags = self._guard("set", lambda: list(self._write_pages(pages)), [False] * len(pages))
        return self._moved(pages, flags, write=True)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._get(self.codec(PoolName.KV).pages(keys, host_indices))

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        if self.backup_skip:  # MLA: TP rank 0 writes for every rank (no pool needed to say so)
            self.stats.add(pages_skipped=len(keys))
            return [True] * len(keys)
        return self._set(self.codec(PoolName.KV).pages(keys, host_indices))

    # ---- v2 -----------------------------------------------------------------------------
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """KV leading pages, then each side pool checked only within that prefix (the anchor
        gates its side pools) under the pool's hit policy."""
        kv_hit = self.batch_exists(keys, extra_info)
        result = PoolTransferResult(kv_hit)
        for transfer in pool_transfers or []:
            if transfer.name is PoolName.KV:
                continue
            codec = self.codec(transfer.name)
            flags = self._guard("exists", lambda: self._page_hits_all(codec, keys[:kv_hit]), [])
            if transfer.hit_policy is PoolHitPolicy.ALL_PAGES:
                result.extra_pool_hit_pages[transfer.name] = leading_hits(flags)
            else:
                result.extra_pool_hit_pages[transfer.name] = trailing_hit(flags, transfer.trailing_pages)
        return result

    def _page_hits_all(self, codec: PoolCodec, keys: list[str]) -> list[bool]:
        names = [codec.object_names(k) for k in keys]
        found = iter(self._exists_objects(codec, [n for page in names for n in page]) if names else [])
        return [all([next(found) for _ in page]) for page in names]

    def _transfer_pages(self, transfers: list[PoolTransfer]) -> list[tuple[PoolTransfer, list[PageIO] | None]]:
        """Each transfer with its pages, or None when its keys or indices do not fit its pool
        (an unregistered pool, a key that is not a string, indices that are not whole pages
        of ``len(keys)`` keys): that pool's transfer fails alone, logged and counted."""
        out = []
        for t in transfers:
            try:
                if t.keys is None or t.host_indices is None:
                    raise ValueError(f"pool transfer {t.name.value!r} needs keys and host_indices")
                out.append((t, self.codec(t.name).pages(t.keys, t.host_indices)))
            except ValueError as exc:
                self.stats.add(failures=1)
                logger.error("%s: pool %s transfer refused: %s", type(self).__name__, t.name.value, exc)
                out.append((t, None))
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        """Read every pool's pages in one backend call (one NIXL transfer per chunk)."""
        parts = self._transfer_pages(transfers)
        flags = iter(self._get([p for _, pages in parts for p in pages or ()]))
        return {t.name: [False] * len(t.keys or ()) if pages is None else [next(flags) for _ in pages]
                for t, pages in parts}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        """Write every pool's pages in one backend call; replicated pools skip on TP rank != 0."""
        parts = self._transfer_pages(transfers)
        skip = {t.name for t, pages in parts if pages and pages[0].codec.replicated and self.config.tp_rank != 0}
        todo = [p for t, pages in parts if t.name not in skip for p in pages or ()]
        flags = iter(self._set(todo))
        out = {}
        for t, pages in parts:
            if pages is None:
                out[t.name] = [False] * len(t.keys or ())
            elif t.name in skip:
                self.stats.add(pages_skipped=len(pages))
                out[t.name] = [True] * len(pages)
            else:
                out[t.name] = [next(flags) for _ in pages]
        return out

    # ---- lifecycle ----------------------------------------------------------------------
    def get_stats(self) -> dict[str, int]:
        return self.stats.snapshot()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()


class HiCacheFile(PagedStorage):
    """The embedded backend: one file per key and pool under a directory (``storage/file/``).

    The directory is the extra config's ``storage_dir`` (or upstream's ``file_storage_path``),
    else ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else ``file_path``, else ``<tempdir>/hicache-<uid>`` (created 0700)."""

    object_format = FILE_OBJECT_FORMAT
    per_component = False

    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str | None = None):
        opts = parse_file_options(storage_config.extra_config, file_path)
        super().__init__(storage_config)
        self.files = PageFiles(opts, self.stats)
        self.file_path = self.files.root

    def _exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
        return self.files.exists_objects(codec, names)

    def _read_pages(self, pages: list[PageIO]) -> list[bool]:
        return self.files.read_pages(pages)

    def _write_pages(self, pages: list[PageIO]) -> list[bool]:
        return self.files.write_pages(pages)

    def clear(self) -> None:
        """Delete every page file under the directory."""
        self.files.clear()

    def _close(self) -> None:
        self.files.close()
