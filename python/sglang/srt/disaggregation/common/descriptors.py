"""Byte ranges of a transfer: (address, length) pairs on both sides, built with numpy.

Every builder returns ``Descs``: two (N, 3) uint64 arrays of (address, length, device id) rows
that pair up one to one, the layout NIXL descriptor lists take. Nothing here reads or writes
the memory the addresses point at, so the builders are tested on fake address spaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang.srt.disaggregation.common.rank_mapping import HeadSlice, StateSlice


@dataclass(frozen=True)
class Descs:
    src: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.src[:, 1].sum()) if len(self) else 0

    @staticmethod
    def concat(parts: list["Descs"]) -> "Descs":
        parts = [p for p in parts if len(p)]
        if not parts:
            return _pack(np.zeros(0), np.zeros(0), np.zeros(0))
        return Descs(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]))


def _pack(src_addr, dst_addr, lengths, device_id: int = 0) -> Descs:
    src_addr, dst_addr, lengths = (np.ravel(a) for a in np.broadcast_arrays(src_addr, dst_addr, lengths))
    src = np.empty((src_addr.size, 3), dtype=np.uint64)
    dst = np.empty((dst_addr.size, 3), dtype=np.uint64)
    src[:, 0], dst[:, 0] = src_addr, dst_addr
    src[:, 1] = dst[:, 1] = lengths
    src[:, 2] = dst[:, 2] = device_id
    return Descs(src, dst)


def _col(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1, 1)


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split page pairs into runs that are consecutive on both sides: (src_starts, dst_starts, lengths)."""
    if src_pages.size != dst_pages.size:
        raise ValueError(f"page lists differ in length: src {src_pages.size}, dst {dst_pages.size}")
    if src_pages.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)
    starts = np.concatenate([[0], np.nonzero(breaks)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [src_pages.size]]))
    return src_pages[starts], dst_pages[starts], lengths


def page_run_count(pages: np.ndarray) -> int:
    """Runs of consecutive page ids: direct descriptors per buffer for these pages, at best."""
    return int(np.count_nonzero(np.diff(pages) != 1)) + 1 if pages.size else 0


def kv_page_descs(src_ptrs, dst_ptrs, item_lens, page_size: int, src_pages: np.ndarray,
                  dst_pages: np.ndarray) -> Descs:
    """Whole pages, one descriptor per (buffer, run of pages consecutive on both sides).

    ``item_lens``: bytes per token slot, equal on both sides. Page ids index both pools.
    """
    s_start, d_start, run_len = page_runs(src_pages, dst_pages)
    page_bytes = _col(item_lens) * page_size
    return _pack(_col(src_ptrs) + s_start * page_bytes, _col(dst_ptrs) + d_start * page_bytes, run_len * page_bytes)


def kv_token_slice_descs(src_ptrs, src_item_lens, dst_ptrs, dst_item_lens, page_size: int,
                         src_pages: np.ndarray, dst_pages: np.ndarray, hs: HeadSlice) -> Descs:
    """Per (buffer, token): ``hs.num_heads`` heads from head ``hs.src_head_offset`` of the source
    token to head ``hs.dst_head_offset`` of the destination token.

    Raises ValueError when a buffer's bytes per head differ between the sides.
    """
    if src_pages.size != dst_pages.size:
        raise ValueError(f"page lists differ in length: src {src_pages.size}, dst {dst_pages.size}")
    src_items, dst_items = _col(src_item_lens), _col(dst_item_lens)
    head_bytes = src_items // hs.src_heads
    if np.any(src_items % hs.src_heads) or np.any(head_bytes * hs.dst_heads != dst_items):
        raise ValueError(
            f"bytes per head differ: src items {src_items.ravel().tolist()} / {hs.src_heads} heads vs "
            f"dst items {dst_items.ravel().tolist()} / {hs.dst_heads} heads"
        )
    tok = np.arange(page_size, dtype=np.int64)
    src_slots = (src_pages.reshape(-1, 1) * page_size + tok).reshape(1, -1)
    dst_slots = (dst_pages.reshape(-1, 1) * page_size + tok).reshape(1, -1)
    src_addr = _col(src_ptrs) + src_slots * src_items + hs.src_head_offset * head_bytes
    dst_addr = _col(dst_ptrs) + dst_slots * dst_items + hs.dst_head_offset * head_bytes
    lengths = np.broadcast_to(head_bytes * hs.num_heads, src_addr.shape)
    return _pack(src_addr, dst_addr, lengths)


def staged_bases(ptr: int, num_tokens: int, widths) -> np.ndarray:
    """Start of each buffer's region in a staged area of ``num_tokens`` tokens at ``ptr``
    (buffer-major, then token: see ``common/staging.py``)."""
    return ptr + num_tokens * np.concatenate([[0], np.cumsum(np.asarray(widths, dtype=np.int64)[:-1])])


def staged_run_descs(widths, src_ptr: int, src_tokens: int, src_first: int, dst_ptr: int, dst_tokens: int,
                     dst_first: int, num_tokens: int) -> Descs:
    """One run per buffer: tokens [src_first, +num_tokens) of the staged area at ``src_ptr``
    (holding ``src_tokens``) to tokens [dst_first, ...) of the one at ``dst_ptr``."""
    w = np.asarray(widths, dtype=np.int64)
    src = staged_bases(src_ptr, src_tokens, w) + src_first * w
    return _pack(src, staged_bases(dst_ptr, dst_tokens, w) + dst_first * w, num_tokens * w)


def into_staging_descs(src_ptrs, src_item_lens, page_size: int, src_pages: np.ndarray, hs: HeadSlice | None,
                       dst_ptr: int, dst_tokens: int, first_page: int, widths) -> Descs:
    """Pool pages straight into a staged area (at ``dst_ptr``, holding ``dst_tokens``) as its
    request pages [first_page, ...): runs of pages when the slice is the whole source token
    (``hs`` None or all its heads), else ``hs.num_heads`` heads per (buffer, token)."""
    bases = staged_bases(dst_ptr, dst_tokens, widths)
    positions = np.arange(first_page, first_page + src_pages.size)
    if hs is None or hs.num_heads == hs.src_heads:
        return kv_page_descs(src_ptrs, bases, widths, page_size, src_pages, positions)
    into = HeadSlice(hs.src_head_offset, 0, hs.num_heads, hs.src_heads, hs.num_heads)
    return kv_token_slice_descs(src_ptrs, src_item_lens, bases, widths, page_size, src_pages, positions, into)


def state_descs(src_ptrs, src_item_lens, src_rows, dst_ptrs, dst_item_lens, dst_rows, src_slots: np.ndarray,
                dst_slots: np.ndarray, slices) -> Descs:
    """Per (state buffer, row run, request slot pair): ``run.num_rows`` rows of dim 0 of the item.

    ``slices[i]``: the row runs of buffer i (a list of StateSlice, one StateSlice, or None for
    none). ``src_rows`` / ``dst_rows``: rows per item on each side; a row has the same bytes on both.
    """
    if src_slots.size != dst_slots.size:
        raise ValueError(f"state slot lists differ in length: src {src_slots.size}, dst {dst_slots.size}")
    parts = []
    for i, runs in enumerate(slices):
        runs = [] if runs is None else [runs] if isinstance(runs, StateSlice) else runs
        if not runs:
            continue
        row_bytes = src_item_lens[i] // src_rows[i]
        if row_bytes * dst_rows[i] != dst_item_lens[i]:
            raise ValueError(
                f"state buffer {i}: row bytes differ: src {src_item_lens[i]}/{src_rows[i]}, "
                f"dst {dst_item_lens[i]}/{dst_rows[i]}"
            )
        for sl in runs:
            src = src_ptrs[i] + src_slots * src_item_lens[i] + sl.src_row_offset * row_bytes
            dst = dst_ptrs[i] + dst_slots * dst_item_lens[i] + sl.dst_row_offset * row_bytes
            parts.append(_pack(src, dst, sl.num_rows * row_bytes))
    return Descs.concat(parts)


def row_descs(src_ptrs, dst_ptrs, item_lens, src_row: int, dst_row: int) -> Descs:
    """One item row per buffer (aux data): row ``src_row`` to row ``dst_row``."""
    items = np.asarray(item_lens, dtype=np.int64)
    return _pack(np.asarray(src_ptrs, dtype=np.int64) + src_row * items,
                 np.asarray(dst_ptrs, dtype=np.int64) + dst_row * items, items)
