"""Staging: move KV through registered DRAM so the wire carries a few long runs.

Every NIXL descriptor costs a fixed few microseconds on UCX/CMA (one ``process_vm_writev``
each), so scattered pages, and worse per-token head slices, spend more time in descriptors
than in bytes. Staging copies the bytes a destination needs into one contiguous area locally
(``gather_slices``), the wire moves that area in one run per buffer, and the receiver copies
them to their place (``scatter_slices``).

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

ALIGN = 64


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

    def bases(self, ptr: int, num_tokens: int) -> np.ndarray:
        """Start address of each buffer's region in a staged area of ``num_tokens`` at ``ptr``."""
        return ptr + num_tokens * np.concatenate([[0], np.cumsum(self.widths[:-1], dtype=np.int64)])


def byte_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over ``nbytes`` of DRAM at ``ptr`` (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _word(*sizes: int) -> torch.dtype:
    """The widest integer dtype dividing every size: fewer, wider elements copy faster."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(s % dtype.itemsize == 0 for s in sizes):
            return dtype
    return torch.uint8


def _views(pool: PoolBuffers, b: int, layout: SliceLayout, page_size: int, num_pages: int, area_ptr: int,
           area_tokens: int, first_token: int):
    """(pool rows, area rows, by_page) for buffer b: page rows when the slice is the whole token
    (one long row per page), else token rows cut to the slice. ``area`` is a staged area."""
    item, off, width = pool.item_lens[b], layout.offsets[b], layout.widths[b]
    by_page = off == 0 and width == item
    word = _word(item, off, width, pool.ptrs[b], area_ptr)
    slots = (pool.lens[b] // (item * page_size)) * page_size
    rows = byte_view(pool.ptrs[b], slots * item).view(word)
    start = area_ptr + area_tokens * sum(layout.widths[:b]) + first_token * width
    area = byte_view(start, num_pages * page_size * width).view(word)
    if by_page:
        return rows.view(-1, page_size * item // word.itemsize), area.view(num_pages, -1), True
    w0, w1 = off // word.itemsize, (off + width) // word.itemsize
    return rows.view(slots, -1)[:, w0:w1], area.view(num_pages * page_size, -1), False


def _index(pages: np.ndarray, page_size: int, by_page: bool) -> torch.Tensor:
    idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
    return idx if by_page else (idx.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)


def gather_slices(pool: PoolBuffers, layout: SliceLayout, page_size: int, pages: np.ndarray, area_ptr: int,
                  area_tokens: int, first_token: int = 0) -> None:
    """Copy the slice of every token of ``pages`` (pool page ids) of each buffer into the staged
    area of ``area_tokens`` tokens at ``area_ptr``, as its tokens ``[first_token, ...)``.
    Reads the pool; writes only the area."""
    for b in range(len(pool.ptrs) if pages.size else 0):
        rows, area, by_page = _views(pool, b, layout, page_size, pages.size, area_ptr, area_tokens, first_token)
        torch.index_select(rows, 0, _index(pages, page_size, by_page), out=area)


def scatter_slices(pool: PoolBuffers, layout: SliceLayout, page_size: int, pages: np.ndarray, area_ptr: int,
                   area_tokens: int, first_token: int = 0) -> None:
    """Inverse of ``gather_slices``: write the area's tokens ``[first_token, ...)`` into the slice
    of every token of ``pages``. Mutates the pool; reads only the area."""
    for b in range(len(pool.ptrs) if pages.size else 0):
        rows, area, by_page = _views(pool, b, layout, page_size, pages.size, area_ptr, area_tokens, first_token)
        rows.index_copy_(0, _index(pages, page_size, by_page), area)


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
