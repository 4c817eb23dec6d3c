"""Paged slot allocator: hands out whole pages of token (or request) slots.

Used by device pools (with the first page reserved as a padding target for writes that must
land somewhere) and by host pools (nothing reserved). Slots are int64 CPU tensors.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from sglang.srt.mem_cache.utils import as_cpu_index, check_in_range, check_page_aligned


class PagedAllocator:
    """Free list of pages over ``num_pages`` pages of ``page_size`` slots.

    ``alloc`` takes pages from the front of a sorted free list; freed pages wait in a release
    list that is merged (and the whole list re-sorted) only when the front runs short, so
    freeing stays cheap. Slot ids are therefore deterministic, but not always the lowest free
    ones. Thread-safe: host pools are shared by the scheduler and the controller's threads.
    """

    def __init__(self, num_pages: int, page_size: int, reserved_pages: int = 0):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 0 or reserved_pages < 0:
            raise ValueError(f"num_pages and reserved_pages must be >= 0, got {num_pages}, {reserved_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.reserved_pages = reserved_pages
        self._lock = threading.RLock()
        self.clear()

    @property
    def size(self) -> int:
        """Usable slots (reserved pages excluded)."""
        return self.num_pages * self.page_size

    @property
    def end_slot(self) -> int:
        return (self.reserved_pages + self.num_pages) * self.page_size

    def clear(self) -> None:
        # Free-list state is numpy (no per-call torch dispatch: these run several times a step,
        # see docs/hicache_design.md "Control-plane cost"); tensors are handed out and taken in.
        with self._lock:
            first = self.reserved_pages
            self._free_pages = np.arange(first, first + self.num_pages, dtype=np.int64)
            self._released: list[np.ndarray] = []
            self._is_free_np = np.zeros(first + self.num_pages, dtype=np.bool_)
            self._is_free_np[first:] = True
            self._is_free = torch.from_numpy(self._is_free_np)  # a view: same memory
            self._num_free = self.num_pages
            self._offs = np.arange(self.page_size, dtype=np.int64)

    def available_size(self) -> int:
        """Free slots."""
        return self._num_free * self.page_size

    def _merge(self) -> None:
        if self._released:
            self._free_pages = np.sort(np.concatenate([self._free_pages, *self._released]))
            self._released = []

    def _take_pages(self, num_pages: int) -> np.ndarray | None:
        with self._lock:
            if num_pages > self._num_free:
                return None
            if num_pages > self._free_pages.size:
                self._merge()
            pages = self._free_pages[:num_pages].copy()
            self._free_pages = self._free_pages[num_pages:]
            self._is_free_np[pages] = False
            self._num_free -= num_pages
            return pages

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Take ``num_pages`` free page ids; None when fewer are free (nothing is taken)."""
        pages = self._take_pages(num_pages)
        return None if pages is None else torch.from_numpy(pages)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` slots (a multiple of page_size) as whole pages.

        Returns an int64 CPU tensor of slot ids, or None when not enough pages are free.
        """
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(
                f"alloc size must be a non-negative multiple of page_size {self.page_size}, got {need_size}"
            )
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return torch.from_numpy((pages[:, None] * self.page_size + self._offs).reshape(-1))

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages.unsqueeze(1) * self.page_size + offs).reshape(-1)

    def free(self, indices, trusted: bool = False) -> None:
        """Return whole pages of slots. Raises ValueError on partial pages, out-of-range or
        double-freed slots; on error nothing is freed.

        ``trusted``: the caller knows ``indices`` are whole pages (a tree freeing slot lists it
        checked for that when they entered it, or that ``alloc`` made), so the page check, most
        of this call's cost, is skipped; the range, a page named twice or one already free still
        raise. Validate once where indices are produced (issue 9)."""
        slots = as_cpu_index(indices, "free indices")
        if slots.numel() == 0:
            return
        if not trusted:
            check_page_aligned(slots, self.page_size, "free indices")
        check_in_range(slots, self.reserved_pages * self.page_size, self.end_slot, "free indices")
        pages = slots.numpy()[:: self.page_size] // self.page_size
        with self._lock:
            # ascending pages are unique; else sort (np.unique costs ~10x more, and its first call
            # imports numpy.ma: milliseconds inside a scheduler step)
            if pages.size > 1 and not (pages[1:] > pages[:-1]).all():
                ordered = np.sort(pages)
                if (ordered[1:] == ordered[:-1]).any():
                    raise ValueError("free indices name the same page twice")
            was_free = self._is_free_np[pages]
            if was_free.any():
                dup = int(pages[was_free][0])
                raise ValueError(f"double free: page {dup} (slot {dup * self.page_size}) is already free")
            self._is_free_np[pages] = True
            self._released.append(pages)
            self._num_free += pages.size

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of these slots lie in free pages."""
        return self._is_free[slots // self.page_size]

    def free_slot_mask(self) -> torch.Tensor:
        """Bool mask over slots [0, end_slot): True where the slot is free (reserved slots False)."""
        return self._is_free.repeat_interleave(self.page_size)


class PagedTokenToKVPoolAllocator(PagedAllocator):
    """Device token-slot allocator over a device pool (upstream's name and keywords). Page 0 is
    reserved (padding target).

    ``dtype`` / ``device``: the KV pool's (default: read from ``kvcache``); slot ids themselves
    are CPU int64 tensors whatever the pool's device. ``need_sort``: accepted for upstream's
    callers; freed pages are always merged back in sorted order, so slot ids are a deterministic
    function of the call sequence (TP ranks rely on that), whatever it says.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype | None = None, device=None, kvcache=None,
                 need_sort: bool = True):
        if size % page_size:
            raise ValueError(f"size {size} is not a multiple of page_size {page_size}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} (pass the pool as kvcache=)")
        super().__init__(size // page_size, page_size, reserved_pages=1)
        self._kvcache = kvcache
        self.dtype = dtype if dtype is not None else getattr(kvcache, "dtype", None)
        self.device = torch.device(device if device is not None else getattr(kvcache, "device", "cpu"))
        self.need_sort = need_sort

    def get_kvcache(self):
        return self._kvcache


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The one-token-page allocator (upstream's ``TokenToKVPoolAllocator``): page_size 1."""

    def __init__(self, size: int, dtype: torch.dtype | None = None, device=None, kvcache=None, need_sort: bool = True):
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
