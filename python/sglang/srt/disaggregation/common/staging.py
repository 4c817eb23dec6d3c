"""Staging: move KV through registered DRAM so the wire carries a few long runs.

Every NIXL descriptor costs a fixed few microseconds on UCX/CMA (one ``process_vm_writev``
each), so scattered pages, and worse per-token head slices, spend more time in descriptors
than in bytes. Staging copies the bytes a destination needs into one contiguous area locally
(``SliceCopier.gather``), the wire moves that area in one run per buffer, and the receiver
copies them to their place (``SliceCopier.scatter``). Area addresses on the wire come from
``descriptors.staged_bases``.

Staged layout of T tokens (``SliceLayout``): buffer-major, then token (request order), then
the slice: (buffer b, token t) sits at ``T * sum(widths[:b]) + t * widths[b]``. A slice is the
byte range ``[offsets[b], offsets[b] + widths[b])`` of a pool token: the whole token, or the
heads one side of a heterogeneous-TP pair holds. Pools are addressed by raw pointer, so
staging works for DRAM pools only.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

try:  # optional C helper built with the package: every range of a copy in one call, GIL released
    from sglang.srt.mem_cache.kvcacheio import _native
except ImportError:  # no compiler at install time: the torch / numpy copies below serve
    _native = None

ALIGN = 64
# Staging copies use ``_native.copy_ranges`` when it is built (one pass, no GIL, no Python per
# range); False forces the torch / numpy fallback (tests run both).
NATIVE_COPY = _native is not None


class PoolBuffers(NamedTuple):
    """A rank's KV buffers as KVArgs lists them: pointers, byte lengths, bytes per token."""

    ptrs: list[int]
    lens: list[int]
    item_lens: list[int]


@dataclass(frozen=True)
class SliceLayout:
    """The bytes of every token of each buffer a staged transfer carries (see module doc)."""

    offsets: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def of_heads(cls, item_lens, heads_per_token: int, head_offset: int, num_heads: int) -> "SliceLayout":
        """``num_heads`` heads from local head ``head_offset`` of tokens holding ``heads_per_token``."""
        head_bytes = [int(i) // heads_per_token for i in item_lens]
        return cls(tuple(h * head_offset for h in head_bytes), tuple(h * num_heads for h in head_bytes))

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * sum(self.widths)


def byte_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over ``nbytes`` of DRAM at ``ptr`` (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _word(*sizes: int) -> torch.dtype:
    """The widest integer dtype dividing every size: fewer, wider elements copy faster."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(s % dtype.itemsize == 0 for s in sizes):
            return dtype
    return torch.uint8


class SliceCopier:
    """Copies the ``layout`` slice of a pool's tokens to and from staged areas (module doc).

    A whole-token slice copies whole pages (one range per page); a cut one copies token rows.
    With the native helper (``NATIVE_COPY``) each buffer is one ``copy_ranges`` call over
    numpy-built offsets: memcpy per range with the GIL released, so a gather can run in a
    thread beside a NIXL post (measured 1.2-2.4x the torch path on the 2-core dev box, see
    docs/pd_transfer.md). Without it, pool views are built once per buffer and word size; gathers
    use torch (its intra-op threads), scatters numpy fancy assignment (faster single-threaded
    than torch index_copy_ here).
    """

    def __init__(self, pool: PoolBuffers, layout: SliceLayout, page_size: int):
        self.pool, self.layout, self.page_size = pool, layout, page_size
        self._rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._by_page = [o == 0 and w == i for o, w, i in zip(layout.offsets, layout.widths, pool.item_lens)]
        self._starts = np.concatenate([[0], np.cumsum(layout.widths[:-1], dtype=np.int64)]).tolist()

    def _pool_rows(self, b: int, word: torch.dtype) -> torch.Tensor:
        rows = self._rows.get((b, word))
        if rows is None:
            item, page_size = self.pool.item_lens[b], self.page_size
            slots = (self.pool.lens[b] // (item * page_size)) * page_size
            rows = byte_view(self.pool.ptrs[b], slots * item).view(word)
            if self._by_page[b]:
                rows = rows.view(-1, page_size * item // word.itemsize)
            else:
                off, width = self.layout.offsets[b], self.layout.widths[b]
                rows = rows.view(slots, -1)[:, off // word.itemsize:(off + width) // word.itemsize]
            self._rows[(b, word)] = rows
        return rows

    def _pairs(self, pages: np.ndarray, area: torch.Tensor, area_tokens: int, first_token: int):
        """(pool rows, area rows, index) per buffer for copying ``pages`` at ``first_token``."""
        page_idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
        slot_idx = None
        for b, width in enumerate(self.layout.widths):
            start = area_tokens * self._starts[b] + first_token * width
            nbytes = pages.size * self.page_size * width
            word = _word(self.pool.item_lens[b], self.layout.offsets[b], width, self.pool.ptrs[b],
                         area.data_ptr() + start)
            rows = self._pool_rows(b, word)
            if self._by_page[b]:
                yield rows, area[start:start + nbytes].view(word).view(pages.size, -1), page_idx
                continue
            if slot_idx is None:
                slot_idx = (page_idx.view(-1, 1) * self.page_size + torch.arange(self.page_size)).view(-1)
            yield rows, area[start:start + nbytes].view(word).view(slot_idx.numel(), -1), slot_idx

    def gather(self, pages: np.ndarray, area: torch.Tensor, area_tokens: int, first_token: int = 0) -> None:
        """Copy the slice of every token of ``pages`` (pool page ids) into ``area`` (uint8, a
        staged area of ``area_tokens`` tokens) as its tokens ``[first_token, ...)``. Reads the
        pool; writes only the area."""
        if not pages.size:
            return
        self._check_area(pages, area, area_tokens, first_token)
        if NATIVE_COPY:
            return self._native(pages, area, area_tokens, first_token, to_area=True)
        for rows, dst, idx in self._pairs(pages, area, area_tokens, first_token):
            torch.index_select(rows, 0, idx, out=dst)

    def scatter(self, pages: np.ndarray, area: torch.Tensor, area_tokens: int, first_token: int = 0) -> None:
        """Inverse of ``gather``: write the area's tokens ``[first_token, ...)`` into the slice of
        every token of ``pages``. Mutates the pool; reads only the area."""
        if not pages.size:
            return
        self._check_area(pages, area, area_tokens, first_token)
        if NATIVE_COPY:
            return self._native(pages, area, area_tokens, first_token, to_area=False)
        for rows, src, idx in self._pairs(pages, area, area_tokens, first_token):
            rows.numpy()[idx.numpy()] = src.numpy()

    def _check_area(self, pages: np.ndarray, area: torch.Tensor, area_tokens: int, first_token: int) -> None:
        """ValueError, before anything is copied, unless ``area`` is a contiguous CPU uint8
        tensor holding ``area_tokens`` tokens of which the copied ones are a part."""
        if area.dtype != torch.uint8 or not area.is_contiguous() or area.device.type != "cpu":
            raise ValueError(f"staged area must be a contiguous CPU uint8 tensor, got {area.dtype} on {area.device}")
        need, end = self.layout.nbytes(area_tokens), first_token + pages.size * self.page_size
        if area.numel() < need or first_token < 0 or end > area_tokens:
            raise ValueError(f"staged area of {area.numel()} bytes cannot hold tokens [{first_token}, {end}) of "
                             f"{area_tokens} ({need} bytes needed)")

    def _native(self, pages: np.ndarray, area: torch.Tensor, area_tokens: int, first_token: int,
                to_area: bool) -> None:
        """Gather (``to_area``) or scatter with one ``copy_ranges`` per buffer, which checks
        every range of its buffer against both sides before copying (ValueError)."""
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        page_size, area_ptr, area_len = self.page_size, area.data_ptr(), area.numel()
        pos = {}  # ranges per buffer: pages (whole) or tokens (cut), as positions in the area
        slots = None
        for b, width in enumerate(self.layout.widths):
            item, ptr, nbytes = self.pool.item_lens[b], self.pool.ptrs[b], self.pool.lens[b]
            start = area_tokens * self._starts[b] + first_token * width
            if self._by_page[b]:
                length = page_size * item
                pool_off = pages * length
            else:
                if slots is None:
                    slots = (pages.reshape(-1, 1) * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
                length = width
                pool_off = slots * item + self.layout.offsets[b]
            count = pool_off.size
            if count not in pos:
                pos[count] = np.arange(count, dtype=np.int64)
            area_off = pos[count] * length + start
            if to_area:
                _native.copy_ranges(ptr, nbytes, area_ptr, area_len, pool_off, area_off, length)
            else:
                _native.copy_ranges(area_ptr, area_len, ptr, nbytes, area_off, pool_off, length)


class StagingArea:
    """A registered DRAM region handed out in aligned byte ranges (first fit). Thread-safe."""

    def __init__(self, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"staging bytes must be >= 0, got {nbytes}")
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)  # zeros touches the pages now
        self.ptr, self.nbytes = self.tensor.data_ptr(), nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up to ALIGN), or None when none fits."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    self._free[i] = (off + size, length - size)
                    return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        """Return a range from ``alloc``; ValueError when it overlaps free space (double free)."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            if off < 0 or off + size > self.nbytes or any(o < off + size and off < o + n for o, n in self._free):
                raise ValueError(f"staging range [{off}, {off + size}) is out of bounds or already free")
            self._free.append((off, size))
            self._free.sort()
            merged = [self._free[0]]
            for o, n in self._free[1:]:
                if merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = [(o, n) for o, n in merged if n]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)
