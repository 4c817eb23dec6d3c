"""How one registered host pool maps to stored objects: names, payload sizes, host byte views.

A key's page is stored as one object per *segment*. With ``per_component`` (NIXL) a segment is
one component (MHA: K and V -> ``_k``, ``_v``; Mamba: ``_mamba_temporal``, ``_mamba_conv_<i>``;
DSA: ``_indexer_k``, ``_indexer_v``); otherwise (file) the whole flat page is one segment. A
pool without bytes (the DeepSeek-V4 logical anchor) has one empty ``marker`` segment, so its
existence can gate side-pool lookups.

Segment payloads are the canonical flat-page bytes (the same for every layout with the same
``page_format``): the views are the chunks of ``get_page_buffer_meta`` in meta order, as numpy
uint8 views of the pool's host buffers (see :class:`PageViews`). In span mode one key covers
``pages_per_key`` host pages (HiCacheStorageConfig.storage_page_size): each segment holds that
component of every host page of the key, page after page. A staged pool (``pool_shape.py``)
moves through a private copy of its flat pages, written back by :meth:`PageIO.commit` once a
read verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.page_views import PageViews
from sglang.srt.mem_cache.storage.pool_shape import PoolShape, pool_shape
from sglang.srt.mem_cache.storage.keys import (
    GROUP_SEPARATOR,
    MARKER_TAG,
    KeyDeriver,
    ShardMode,
    StorageNamespace,
    object_suffix,
    page_group,
)
from sglang.srt.mem_cache.utils import as_cpu_index


NAME_CACHE_PAGES = 1 << 16  # ~20 MiB of names at most per pool


@dataclass(frozen=True)
class Segment:
    suffix: str
    nbytes: int  # payload bytes per page
    first_chunk: int  # range of this segment in the page's chunks (get_page_buffer_meta order)
    num_chunks: int


@dataclass(slots=True)
class ObjectIO:
    """One object of one page: its name and the host memory its payload lives in."""

    name: str
    views: list[np.ndarray]  # contiguous uint8 views of host memory, in payload order
    ptrs: list[int]  # their addresses
    nbytes: int


class PageIO:
    """One key's page of one pool: its host pages' first slots and object names. ``objects``
    (names with host views) is built on first use: the native batch paths never need it."""

    __slots__ = ("codec", "slots", "names", "_objects", "_staged")

    def __init__(self, codec: "PoolCodec", slots: tuple[int, ...], names: list[str]):
        self.codec, self.slots, self.names, self._objects, self._staged = codec, slots, names, None, None

    @property
    def slot(self) -> int:
        """First slot of the key's first host page."""
        return self.slots[0]

    @property
    def objects(self) -> list[ObjectIO]:
        if self._objects is None:
            if self.codec.shape.staged:
                self._staged = self.codec.staged_copy(self.slots)
            self._objects = self.codec.page_objects(self.slots, self.names, self._staged)
        return self._objects

    def commit(self) -> None:
        """After a verified read of a staged pool's page: write it into the pool
        (``set_from_flat_data_page``). A no-op for pools read in place."""
        if self._staged is not None:
            self.codec.write_back(self.slots, self._staged)

    @property
    def nbytes(self) -> int:
        return self.codec.page_nbytes

    def zero(self) -> None:
        """Wipe the page's host bytes (after a failed read, so no unverified byte stays)."""
        for obj in self.objects:
            for view in obj.views:
                view.fill(0)


def page_starts(idx: np.ndarray, page_size: int, size: int) -> list[int]:
    """First slot of each page of ``idx`` (whole pages of ``page_size`` consecutive slots in
    [0, size)); ValueError otherwise. The checks of ``mem_cache.utils`` in numpy: torch spreads
    them over its OpenMP threads, which costs milliseconds per batch on a busy host."""
    if idx.size == 0:
        return []
    if idx.size % page_size:
        raise ValueError(f"host indices: length {idx.size} is not a multiple of page_size {page_size}")
    rows = idx.reshape(-1, page_size)
    starts = rows[:, 0]
    misaligned = starts % page_size != 0
    if misaligned.any():
        raise ValueError(f"host indices: page starts at slot {int(starts[misaligned][0])}, "
                         f"not a multiple of page_size {page_size}")
    if page_size > 1 and not np.array_equal(rows, starts[:, None] + np.arange(page_size)):
        raise ValueError(f"host indices: a page is not {page_size} consecutive slots")
    lo, hi = int(starts.min()), int(starts.max()) + page_size - 1
    if lo < 0 or hi >= size:
        raise ValueError(f"host indices out of range: min {lo}, max {hi}, allowed [0, {size})")
    return starts.tolist()


def _segments(pool_name: PoolName, shape: PoolShape, per_component: bool, k: int) -> list[Segment]:
    """The segments of a key's page of ``k`` host pages (chunks counted per host page)."""
    comps = shape.segments
    if not comps or not any(c.nbytes for c in comps):
        return [Segment(object_suffix(pool_name.value, MARKER_TAG), 0, 0, 0)]
    if not per_component or shape.staged:
        return [Segment(object_suffix(pool_name.value, ""), k * sum(c.nbytes for c in comps), 0,
                        sum(c.num_chunks for c in comps))]
    out, first = [], 0
    for c in comps:
        out.append(Segment(object_suffix(pool_name.value, c.tag), k * c.nbytes, first, c.num_chunks))
        first += c.num_chunks
    return out


class PoolCodec:
    """Object names and host views of the pages of one registered pool."""

    def __init__(self, name: PoolName, host_pool, namespace: StorageNamespace, per_component: bool,
                 grouped: bool = False, pages_per_key: int = 1, shape: PoolShape | None = None):
        """``grouped``: object names start with the key's group and GROUP_SEPARATOR
        (``<group>.<stem><suffix>``), so every object of one key shares a prefix.
        ``pages_per_key``: host pages one key covers (span mode)."""
        self.name = PoolName(name)
        self.grouped = grouped
        self.host_pool = host_pool
        self.namespace = namespace
        self.shape = shape if shape is not None else pool_shape(
            host_pool, self.name, namespace.shard_mode is ShardMode.REPLICATED)
        if pages_per_key < 1:
            raise ValueError(f"pool {self.name.value!r}: pages_per_key must be >= 1, got {pages_per_key}")
        self.pages_per_key = pages_per_key
        self.keys = KeyDeriver(namespace)
        self.segments = _segments(self.name, self.shape, per_component, pages_per_key)
        if len({s.suffix for s in self.segments}) != len(self.segments):
            raise ValueError(f"pool {self.name.value!r}: two components map to one object suffix")
        self.is_marker = self.segments[0].nbytes == 0  # a pool without bytes: one empty marker object
        page_num = self.shape.page_num
        self.page_views = None
        if not self.shape.staged and not self.is_marker:
            views = PageViews(host_pool, self.shape.buffers, page_num if page_num is not None else 0,
                              self.shape.page_size)
            if views.affine or self.shape.native:  # a native pool falls back to get_data_page views
                self.page_views = views
            else:
                self.shape.buffers = None  # an upstream-style pool whose meta is not affine: staged
                self.segments = _segments(self.name, self.shape, per_component, pages_per_key)
        self._names: dict[str, list[str]] = {}  # key -> object names (see object_names)
        self._one = self.segments[0] if len(self.segments) == 1 and not self.is_marker else None
        self.page_nbytes = sum(s.nbytes for s in self.segments)

    @property
    def page_size(self) -> int:
        """Host slots of one host page."""
        return self.shape.page_size

    @property
    def key_slots(self) -> int:
        """Host slots one key covers."""
        return self.shape.page_size * self.pages_per_key

    @property
    def replicated(self) -> bool:
        return self.namespace.shard_mode is ShardMode.REPLICATED

    @property
    def zero_copy(self) -> bool:
        """Whether pages move straight between host memory and storage (not staged)."""
        return self.page_views is not None

    def host_buffers(self) -> list[torch.Tensor]:
        """The uint8 host buffers the pool's pages live in (empty for staged or marker pools)."""
        return [] if self.shape.staged or self.is_marker else list(self.shape.buffers)

    def object_names(self, key: str) -> list[str]:
        """Object names of a key's page (a bounded cache: a get usually follows an exists or a
        set of the same keys, and deriving a name costs a sha256 or two). Do not mutate it."""
        names = self._names.get(key)
        if names is not None:
            return names
        stem = self.stem(key)
        names = [stem + s.suffix for s in self.segments]
        if len(self._names) >= NAME_CACHE_PAGES:
            self._names.clear()  # cheaper than LRU order upkeep on every lookup; refills at once
        self._names[key] = names
        return names

    def stem(self, key: str) -> str:
        """The part of ``key``'s object names before the object suffix."""
        stem = self.keys.stem(key)
        return page_group(key) + GROUP_SEPARATOR + stem if self.grouped else stem

    def page_slots(self, keys: list[str], host_indices) -> list[tuple[int, ...]]:
        """First slot of each host page of each key; ValueError unless the indices are whole
        host pages, ``pages_per_key`` of them per key."""
        idx = as_cpu_index(host_indices, "host indices")
        P, K = self.page_size, self.pages_per_key
        if idx.numel() != len(keys) * P * K:
            span = f" ({K} pages of {P} slots per key)" if K > 1 else ""
            raise ValueError(f"pool {self.name.value!r}: {len(keys)} keys need {len(keys) * P * K} host indices"
                             f"{span}, got {idx.numel()}")
        size = self.shape.size
        starts = page_starts(idx.numpy(), P, size if size is not None else np.iinfo(np.int64).max)
        if K == 1:
            return [(s,) for s in starts]
        return [tuple(starts[i : i + K]) for i in range(0, len(starts), K)]

    def pages(self, keys: list[str], host_indices) -> list[PageIO]:
        """PageIO of each (key, page) pair (validates keys and indices first)."""
        slots = self.page_slots(keys, host_indices)
        names = [self.object_names(k) for k in keys]
        return [PageIO(self, key_slots, page_names) for key_slots, page_names in zip(slots, names)]

    def page_objects(self, slots: tuple[int, ...], names: list[str], staged=None) -> list[ObjectIO]:
        """The objects of the key page whose host pages start at ``slots``: names with the host
        views of their payloads (of ``staged``, the private copies, for a staged pool)."""
        if self.is_marker:
            return [ObjectIO(name, [], [], 0) for name in names]
        pages = [self._host_chunks(s, staged, j) for j, s in enumerate(slots)]
        if self._one is not None:  # one object per page: its views are the pages' chunks
            return [ObjectIO(names[0], [v for vs, _ in pages for v in vs], [p for _, ps in pages for p in ps],
                             self._one.nbytes)]
        out = []
        for name, s in zip(names, self.segments):
            views, ptrs = [], []
            for vs, ps in pages:
                views.extend(vs[s.first_chunk : s.first_chunk + s.num_chunks])
                ptrs.extend(ps[s.first_chunk : s.first_chunk + s.num_chunks])
            out.append(ObjectIO(name, views, ptrs, s.nbytes))
        return out

    def _host_chunks(self, slot: int, staged, j: int) -> tuple[list[np.ndarray], list[int]]:
        if staged is not None:
            array = staged[j]
            return [array], [array.ctypes.data]
        return self.page_views.chunks(slot // self.page_size)

    def staged_copy(self, slots: tuple[int, ...]) -> list[np.ndarray]:
        """Private uint8 copies of the flat host pages at ``slots`` (a staged pool)."""
        want = self.shape.segments[0].nbytes
        out = []
        for slot in slots:
            page = self.host_pool.get_data_page(slot, flat=True)
            copy = torch.empty(page.numel(), dtype=page.dtype)
            copy.copy_(page.reshape(-1))
            array = copy.view(torch.uint8).numpy()
            if array.nbytes != want:
                raise ValueError(f"pool {self.name.value!r}: the flat page at slot {slot} has {array.nbytes} bytes, "
                                 f"get_dummy_flat_data_page has {want}")
            out.append(array)
        return out

    def write_back(self, slots: tuple[int, ...], staged: list[np.ndarray]) -> None:
        """Store verified staged copies into the pool (``set_from_flat_data_page``)."""
        for slot, array in zip(slots, staged):
            self.host_pool.set_from_flat_data_page(slot, torch.from_numpy(array).view(self.shape.flat_dtype))

    def object_iovecs(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Host memory of every object of the key pages whose host pages start at ``slots``
        (``pages_per_key`` first slots per key, key after key: ``PageIO.slots`` concatenated),
        objects key after key in segment order, as int64 arrays: iovec addresses and lengths,
        and ``starts`` (object i owns iovecs starts[i] .. starts[i + 1]). None when the pool's
        pages are not affine in its buffers or it is staged (see PageViews); a marker pool's
        objects own no iovec."""
        K = self.pages_per_key
        n = len(slots) // K
        counts = [0 if self.is_marker else s.num_chunks * K for s in self.segments]
        starts = np.zeros(n * len(counts) + 1, dtype=np.int64)
        if self.is_marker:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), starts
        if self.page_views is None:
            return None
        first = np.asarray(slots, dtype=np.int64) // self.page_size
        iov = self.page_views.iovecs(first)
        if iov is None:
            return None
        addrs, lens = iov
        if K > 1 and len(self.segments) > 1:  # [key][host page][chunk] -> [key][segment][host page][chunk]
            order = np.arange(len(addrs), dtype=np.int64).reshape(n, K, -1)
            order = np.concatenate([order[:, :, s.first_chunk : s.first_chunk + s.num_chunks].reshape(n, -1)
                                    for s in self.segments], axis=1).reshape(-1)
            addrs, lens = addrs[order], lens[order]
        np.cumsum(np.tile(np.asarray(counts, dtype=np.int64), n), out=starts[1:])
        return addrs, lens, starts
