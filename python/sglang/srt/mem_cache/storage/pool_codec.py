"""How one registered host pool maps to stored objects: names, payload sizes, host byte views.

A page of a pool is stored as one object per *segment*. With ``per_component`` (NIXL) a
segment is one component (MHA: K and V -> ``_k``, ``_v``; Mamba: ``_mamba_temporal``,
``_mamba_conv_<i>``; DSA: ``_indexer_k``, ``_indexer_v``); otherwise (file) the whole flat page
is one segment. A pool without bytes (the DeepSeek-V4 logical anchor) has one empty ``marker``
segment, so its existence can gate side-pool lookups.

Segment payloads are the canonical flat-page bytes (the same for every layout with the same
``page_format``): the views are the chunks of ``get_page_buffer_meta`` in meta order, as numpy
uint8 views of the pool's host buffers (see :class:`PageViews`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.page_views import PageViews
from sglang.srt.mem_cache.storage.keys import (
    GROUP_SEPARATOR,
    MARKER_TAG,
    KeyDeriver,
    ShardMode,
    StorageNamespace,
    component_tag,
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
    """One page of one pool: its first host slot and object names. ``objects`` (names with host
    views) is built on first use: the native batch paths of the backends never need it."""

    __slots__ = ("codec", "slot", "names", "_objects")

    def __init__(self, codec: "PoolCodec", slot: int, names: list[str]):
        self.codec, self.slot, self.names, self._objects = codec, slot, names, None

    @property
    def objects(self) -> list[ObjectIO]:
        if self._objects is None:
            self._objects = self.codec.page_objects(self.slot, self.names)
        return self._objects

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


def _segments(pool_name: PoolName, host_pool, per_component: bool) -> list[Segment]:
    comps = list(host_pool.components)
    if not comps:
        return [Segment(object_suffix(pool_name.value, MARKER_TAG), 0, 0, 0)]
    chunks_per_comp = host_pool.buffers_per_page() // len(comps)
    page_bytes = [c.item_bytes * host_pool.layer_num * host_pool.page_size for c in comps]
    if not per_component:
        return [Segment(object_suffix(pool_name.value, ""), sum(page_bytes), 0, chunks_per_comp * len(comps))]
    return [
        Segment(object_suffix(pool_name.value, component_tag(c.name)), nbytes, i * chunks_per_comp, chunks_per_comp)
        for i, (c, nbytes) in enumerate(zip(comps, page_bytes))
    ]


class PoolCodec:
    """Object names and host views of the pages of one registered pool."""

    def __init__(self, name: PoolName, host_pool, namespace: StorageNamespace, per_component: bool,
                 grouped: bool = False):
        """``grouped``: object names start with the page's group and GROUP_SEPARATOR
        (``<group>.<stem><suffix>``), so every object of one page hash shares a prefix."""
        self.name = PoolName(name)
        self.grouped = grouped
        self.host_pool = host_pool
        self.namespace = namespace
        self.keys = KeyDeriver(namespace)
        self.segments = _segments(self.name, host_pool, per_component)
        if len({s.suffix for s in self.segments}) != len(self.segments):
            raise ValueError(f"pool {self.name.value!r}: two components map to one object suffix")
        self.page_views = PageViews(host_pool)
        self.is_marker = self.segments[0].nbytes == 0  # a pool without bytes: one empty marker object
        self._names: dict[str, list[str]] = {}  # page hash -> object names (see object_names)
        self._one = self.segments[0] if len(self.segments) == 1 and not self.is_marker else None
        self.page_nbytes = sum(s.nbytes for s in self.segments)

    @property
    def page_size(self) -> int:
        return self.host_pool.page_size

    @property
    def replicated(self) -> bool:
        return self.namespace.shard_mode is ShardMode.REPLICATED

    def object_names(self, page_hash: str) -> list[str]:
        """Object names of a page (a bounded cache: a get usually follows an exists or a set of
        the same keys, and deriving a name costs a sha256 or two). Do not mutate the list."""
        names = self._names.get(page_hash)
        if names is not None:
            return names
        stem = self.keys.stem(page_hash)
        if self.grouped:
            stem = page_group(page_hash) + GROUP_SEPARATOR + stem
        names = [stem + s.suffix for s in self.segments]
        if len(self._names) >= NAME_CACHE_PAGES:
            self._names.clear()  # cheaper than LRU order upkeep on every lookup; refills at once
        self._names[page_hash] = names
        return names

    def page_slots(self, keys: list[str], host_indices) -> list[int]:
        """First host slot of each page; ValueError unless indices are whole pages, one per key."""
        idx = as_cpu_index(host_indices, "host indices")
        P = self.page_size
        if idx.numel() != len(keys) * P:
            raise ValueError(
                f"pool {self.name.value!r}: {len(keys)} keys need {len(keys) * P} host indices, got {idx.numel()}"
            )
        return page_starts(idx.numpy(), P, self.host_pool.size)

    def pages(self, keys: list[str], host_indices) -> list[PageIO]:
        """PageIO of each (key, page) pair (validates keys and indices first)."""
        slots = self.page_slots(keys, host_indices)
        names = [self.object_names(k) for k in keys]
        return [self.page_io(slot, page_names) for slot, page_names in zip(slots, names)]

    def page_io(self, slot: int, names: list[str]) -> PageIO:
        return PageIO(self, slot, names)

    def page_objects(self, slot: int, names: list[str]) -> list[ObjectIO]:
        """The objects of the page at ``slot``: names with the host views of their payloads."""
        if self._one is not None:  # one object per page: its views are the page's chunks
            views, ptrs = self.page_views.chunks(slot // self.page_size)
            return [ObjectIO(names[0], views, ptrs, self._one.nbytes)]
        views, ptrs = self.page_views.chunks(slot // self.page_size) if not self.is_marker else ([], [])
        return [
            ObjectIO(name, views[s.first_chunk : s.first_chunk + s.num_chunks],
                     ptrs[s.first_chunk : s.first_chunk + s.num_chunks], s.nbytes)
            for name, s in zip(names, self.segments)
        ]

    def object_iovecs(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Host memory of every object of the pages at ``slots``, objects page after page in
        segment order, as int64 arrays: iovec addresses and lengths, and ``starts`` (object i
        owns iovecs starts[i] .. starts[i + 1]). None when the pool's pages are not affine in
        its buffers (see PageViews); a marker pool's objects own no iovec."""
        counts = [0 if self.is_marker else s.num_chunks for s in self.segments]
        starts = np.zeros(len(slots) * len(counts) + 1, dtype=np.int64)
        if self.is_marker:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), starts
        iov = self.page_views.iovecs(np.asarray(slots, dtype=np.int64) // self.page_size)
        if iov is None:
            return None
        np.cumsum(np.tile(np.asarray(counts, dtype=np.int64), len(slots)), out=starts[1:])
        return iov[0], iov[1], starts
