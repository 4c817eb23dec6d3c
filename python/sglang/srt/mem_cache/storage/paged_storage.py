"""PagedStorage: the v1/v2 HiCacheStorage API over a backend's three object primitives.

A backend subclass provides ``_exists_objects`` (which names are stored), ``_read_pages`` and
``_write_pages`` (move pages, verify integrity, one flag per page). This class owns everything
else, identically for every backend: pool registration and keys, argument validation, hit
policies, the MLA backup skip, counters, and the fault guard that turns any backend exception
into a counted failure and a miss.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    StorageBackendError,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    leading_hits,
)
from sglang.srt.mem_cache.storage.pool_codec import PageIO, PoolCodec
from sglang.srt.mem_cache.storage.stats import StorageStats
from sglang.srt.mem_cache.storage.keys import StorageNamespace

logger = logging.getLogger(__name__)


def trailing_hit(flags: list[bool], n: int) -> int:
    """Largest L <= len(flags) with flags[L-n:L] all True (a state usable at prefix L), else 0."""
    for end in range(len(flags), n - 1, -1):
        if all(flags[end - n : end]):
            return end
    return 0


class PagedStorage(HiCacheStorage):
    object_format: str  # the framing of a stored object; part of every key namespace
    per_component: bool  # one object per component (True) or per flat page (False)
    grouped_names = False  # object names carry the page group (see PoolCodec)

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host=None):
        self.config = storage_config
        self.stats = StorageStats()
        self.codecs: dict[PoolName, PoolCodec] = {}
        self.backup_skip = storage_config.is_mla_model and storage_config.tp_rank != 0
        self._closed = False
        self._close_lock = threading.Lock()
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # ---- registration -------------------------------------------------------------------
    def register_mem_pool_host(self, host_pool) -> None:
        """Register the anchor pool (a HostPoolGroup registers its side pools too)."""
        anchor = getattr(host_pool, "anchor_pool", host_pool)
        if anchor.page_format != self.config.page_format:
            raise ValueError(
                f"host pool page format {anchor.page_format!r} differs from the storage config's "
                f"{self.config.page_format!r}; build the config from this pool"
            )
        self._register(PoolName.KV, anchor)
        for name, entry in getattr(host_pool, "entries", {}).items():
            if entry.host_pool is not anchor:
                self.register_mem_host_pool_v2(entry.host_pool, name)

    def register_mem_host_pool_v2(self, host_pool, name: PoolName) -> None:
        """Register a side pool; for ``PoolName.KV`` only checks it is the registered anchor."""
        name = PoolName(name)
        known = self.codecs.get(name)
        if known is not None:
            if known.host_pool is not host_pool:
                raise ValueError(f"pool {name.value!r} is already registered with another host pool")
            return
        self._register(name, host_pool)

    def _register(self, name: PoolName, host_pool) -> None:
        if name in self.codecs:
            return
        namespace = StorageNamespace.for_pool(self.config, host_pool, name.value, self.object_format)
        codec = PoolCodec(name, host_pool, namespace, self.per_component, self.grouped_names)
        self._on_register(codec)
        self.codecs[name] = codec
        logger.info("%s: registered pool %s (%d objects per page)", type(self).__name__, name.value, len(codec.segments))

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
            codec.keys.stem(key)  # validate before any I/O
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
        return self._moved(pages, flags, write=False)

    def _set(self, pages: list[PageIO]) -> list[bool]:
        if not pages:
            return []
        flags = self._guard("set", lambda: list(self._write_pages(pages)), [False] * len(pages))
        return self._moved(pages, flags, write=True)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._get(self.codec(PoolName.KV).pages(keys, host_indices))

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        pages = self.codec(PoolName.KV).pages(keys, host_indices)
        if self.backup_skip:  # MLA: TP rank 0 writes for every rank
            self.stats.add(pages_skipped=len(pages))
            return [True] * len(pages)
        return self._set(pages)

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

    def _transfer_pages(self, transfers: list[PoolTransfer]) -> list[tuple[PoolTransfer, list[PageIO]]]:
        out = []
        for t in transfers:
            if t.keys is None or t.host_indices is None:
                raise ValueError(f"pool transfer {t.name.value!r} needs keys and host_indices")
            out.append((t, self.codec(t.name).pages(t.keys, t.host_indices)))
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        """Read every pool's pages in one backend call (one NIXL transfer per chunk)."""
        parts = self._transfer_pages(transfers)
        flags = iter(self._get([p for _, pages in parts for p in pages]))
        return {t.name: [next(flags) for _ in pages] for t, pages in parts}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[PoolName, list[bool]]:
        """Write every pool's pages in one backend call; replicated pools skip on TP rank != 0."""
        parts = self._transfer_pages(transfers)
        skip = {t.name for t, pages in parts if pages[:1] and pages[0].codec.replicated and self.config.tp_rank != 0}
        todo = [p for t, pages in parts if t.name not in skip for p in pages]
        flags = iter(self._set(todo))
        out = {}
        for t, pages in parts:
            if t.name in skip:
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
