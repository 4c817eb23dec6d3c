"""Numpy views of a host pool's pages, computed by address arithmetic instead of torch indexing.

``host_pool.get_data_page(slot, flat=False)`` builds a few torch views per page (one per layer
and component for ``layer_first``): microseconds each, which at 64 KiB pages cost as much as
the copy itself. Every host layout places chunk ``j`` of page ``p`` at a fixed offset plus
``p`` times a fixed stride inside one host buffer, so :class:`PageViews` reads the offsets and
strides once from ``get_page_buffer_meta`` of pages 0 and 1, checks them against other pages,
and then cuts each page's chunks as numpy slices of the host buffers. A pool whose chunks do
not follow that rule falls back to ``get_data_page``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)


class PageViews:
    def __init__(self, host_pool, buffers: list[torch.Tensor] | None = None, page_num: int | None = None,
                 page_size: int | None = None):
        """``buffers``: the uint8 host buffers the pool's pages live in; ``page_num``: pages of
        the pool (``page_size`` slots each). Each defaults to what one of this fork's host pools
        says (``get_host_buffers``, ``page_num``, ``page_size``)."""
        self.host_pool = host_pool
        buffers = host_pool.get_host_buffers() if buffers is None else buffers
        self.page_size = host_pool.page_size if page_size is None else page_size
        self.page_num = host_pool.page_num if page_num is None else page_num
        self._arrays = [b.numpy() for b in buffers]
        self._bases = [b.data_ptr() for b in buffers]
        self._chunks = self._affine_chunks()  # (buffer, offset of page 0, stride, bytes) per chunk
        # the same as int64 arrays (address of page 0, stride, bytes), for iovecs
        self._affine = None if self._chunks is None else (
            np.array([self._bases[b] + off for b, off, _, _ in self._chunks], dtype=np.int64),
            np.array([stride for _, _, stride, _ in self._chunks], dtype=np.int64),
            np.array([n for *_, n in self._chunks], dtype=np.int64))
        if self._chunks is None:
            logger.info("%s: pages are not affine in the host buffers", type(host_pool).__name__)

    @property
    def affine(self) -> bool:
        return self._chunks is not None

    def _meta(self, page: int) -> tuple[list[int], list[int]]:
        P = self.page_size
        return self.host_pool.get_page_buffer_meta(torch.arange(page * P, (page + 1) * P))

    def _buffer_of(self, ptr: int, nbytes: int) -> int | None:
        for i, (base, arr) in enumerate(zip(self._bases, self._arrays)):
            if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                return i
        return None

    def _affine_chunks(self) -> list[tuple[int, int, int, int]] | None:
        page_num = self.page_num
        if page_num == 0:
            return []
        try:
            ptrs0, sizes = self._meta(0)
            ptrs1 = self._meta(1)[0] if page_num > 1 else ptrs0
        except (IndexError, ValueError, RuntimeError):  # a pool that refuses the probe
            return None
        chunks = []
        for p0, p1, n in zip(ptrs0, ptrs1, sizes):
            buf = self._buffer_of(p0, n)
            if buf is None:
                return None
            chunks.append((buf, p0 - self._bases[buf], p1 - p0, n))
        for page in {page_num // 2, page_num - 1}:
            ptrs, sizes = self._meta(page)
            if self._formula(chunks, page) != (list(ptrs), list(sizes)):
                return None
        end = [off + (page_num - 1) * stride + n for _, off, stride, n in chunks]
        if any(e > self._arrays[b].nbytes for e, (b, *_) in zip(end, chunks)):
            return None  # the last page would run past its buffer
        return chunks

    def _formula(self, chunks, page: int) -> tuple[list[int], list[int]]:
        return [self._bases[b] + off + page * stride for b, off, stride, _ in chunks], [n for *_, n in chunks]

    def chunks(self, page: int) -> tuple[list[np.ndarray], list[int]]:
        """(uint8 views, addresses) of the chunks of page ``page`` (page index, not slot), in
        ``get_page_buffer_meta`` order. The views alias host memory."""
        if self._chunks is None:
            views = self.host_pool.get_data_page(page * self.page_size, flat=False)
            return [v.numpy() for v in views], [v.data_ptr() for v in views]
        views, ptrs = [], []
        for buf, off, stride, n in self._chunks:
            start = off + page * stride
            views.append(self._arrays[buf][start : start + n])
            ptrs.append(self._bases[buf] + start)
        return views, ptrs

    def iovecs(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(addresses, lengths) as int64 arrays of every chunk of ``pages`` (page indices), page
        after page in chunk order; None when the pages are not affine. The caller keeps the
        pages in range (PoolCodec validates host indices first)."""
        if self._affine is None:
            return None
        first, stride, lens = self._affine
        addrs = first[None, :] + pages.astype(np.int64)[:, None] * stride[None, :]
        return addrs.reshape(-1), np.tile(lens, len(pages))
