"""Staging for heterogeneous TP: turn per-token head slices into whole-page transfers.

A per-token descriptor costs about as much as a page-sized one, so moving n heads per token
as one descriptor each is slow. Instead the side whose tokens are cut gathers (or scatters)
locally through a registered DRAM staging area, and the wire carries contiguous runs:

- Tp < Td (destination tokens whole): prefill gathers the heads into staging laid out like
  the destination pages, then writes page runs.
- Tp > Td (source tokens whole): prefill writes its pages into the decode's staging; decode
  scatters them to their head offset once the request is complete.

Staging layout for one request and one sender: buffer-major, then token (request order), then
the slice bytes: offset of (buffer b, token t) = sum(tokens * slice_bytes[:b]) + t * slice_bytes[b].
Pools are addressed by raw pointer, so staging works for DRAM pools only.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

ALIGN = 64


def byte_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of ``nbytes`` of DRAM at ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class StagingArea:
    """A DRAM region handed out in aligned byte ranges (first fit). Thread-safe."""

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


def staged_bytes(num_tokens: int, slice_bytes) -> int:
    return num_tokens * int(sum(slice_bytes))


def _token_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    return (pages.reshape(-1, 1) * page_size + np.arange(page_size)).reshape(-1)


def gather_heads(ptrs, lens, item_lens, head_bytes, head_offset: int, num_heads: int, page_size: int,
                 pages: np.ndarray, out: np.ndarray) -> None:
    """Copy ``num_heads`` heads from ``head_offset`` of every token of ``pages`` of each pool
    buffer into ``out`` (uint8, staging layout). Reads the pool; writes only ``out``."""
    slots, pos = torch.from_numpy(_token_slots(pages, page_size)), 0
    for ptr, length, item, hb in zip(ptrs, lens, item_lens, head_bytes):
        rows = torch.from_numpy(byte_view(ptr, length - length % item).reshape(-1, item))
        width = num_heads * hb
        dst = torch.from_numpy(out[pos:pos + slots.numel() * width]).view(slots.numel(), width)
        torch.index_select(rows[:, head_offset * hb:head_offset * hb + width], 0, slots, out=dst)  # faster than np.take
        pos += slots.numel() * width


def scatter_heads(ptrs, lens, item_lens, head_bytes, head_offset: int, num_heads: int, page_size: int,
                  pages: np.ndarray, src: np.ndarray) -> None:
    """Inverse of ``gather_heads``: write staged slices into the pool buffers at ``head_offset``
    of every token of ``pages``. Mutates the pool; reads only ``src``."""
    slots, pos = _token_slots(pages, page_size), 0
    for ptr, length, item, hb in zip(ptrs, lens, item_lens, head_bytes):
        rows = byte_view(ptr, length - length % item).reshape(-1, item)
        width = num_heads * hb
        # numpy fancy assignment: faster here than torch index_put_ / index_copy_
        rows[slots, head_offset * hb:head_offset * hb + width] = src[pos:pos + slots.size * width].reshape(-1, width)
        pos += slots.size * width
