"""A few threads that run a per-page function over a batch of pages.

Reading a page is a kernel copy (``preadv`` or a NIXL transfer) and verifying it is a hash;
xxhash releases the GIL for large inputs, as do the syscalls. So with ``io_threads`` > 1 one
thread verifies a page while another reads the next, and a batch of large pages moves at the
copy's speed instead of copy plus hash. Small pages stay on the calling thread: below about
1 MiB the Python work per page (a few microseconds, under the GIL) is no longer small beside
the copy, and the thread handoffs cost more than the overlap saves.

Measured on 2 shared cores with one mostly idle (file backend, 2 threads against 1): 2-4 MiB
pages read 1.3-1.4x and written 1.5x faster, 1 MiB even, 64-256 KiB 10-20% slower (and still
slower with one batch slice per thread: xxhash holds the GIL). NIXL does not use this: it
overlaps the transfer of chunk k + 1 (NIXL releases the GIL) with the verification of chunk k
itself (``HiCacheNixl._read_pages``).

The native batch calls of the file backend (``native_io``) release the GIL for the whole slice
(open, read or write, hash, close), leaving only a few microseconds of Python per page, so with
them the threshold is NATIVE_PARALLEL_MIN_PAGE_BYTES: 64 KiB gets then ran 0.86-0.99x of plain
preadv on two threads against 0.62-0.68x on one (``bench_storage.py``'s ``file_1thread`` row).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_MIN_PAGE_BYTES = 1 << 20
NATIVE_PARALLEL_MIN_PAGE_BYTES = 32 << 10


def _run(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    return [fn(item) for item in items]


def _flat(lists: list[list[R]]) -> list[R]:
    return [x for part in lists for x in part]


class _Slices(list):
    """``items`` cut into ``parts`` contiguous slices (one per thread)."""

    def __init__(self, items: Sequence[T], parts: int):
        step = -(-len(items) // parts)
        super().__init__(items[i : i + step] for i in range(0, len(items), step))


class PageWorkers:
    def __init__(self, threads: int, name: str, min_page_bytes: int = PARALLEL_MIN_PAGE_BYTES):
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        self.threads = threads
        self.min_page_bytes = min_page_bytes
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # the prefetch and backup threads may both start it

    def parallel(self, page_bytes: int) -> bool:
        """Whether pages of ``page_bytes`` are worth spreading over threads."""
        return self.threads > 1 and page_bytes >= self.min_page_bytes

    def map(self, fn: Callable[[T], R], items: Sequence[T], page_bytes: int, flatten: bool = False) -> list[R]:
        """``[fn(item) for item in items]``, in contiguous slices on up to ``threads`` threads
        when the pages are of ``min_page_bytes`` or more, else on the calling thread (``flatten``:
        each ``fn(item)`` is a list, concatenated). An
        exception in any slice propagates once all slices have finished, so that no thread
        still touches host memory when the caller handles it."""
        if len(items) < 2 or not self.parallel(page_bytes):
            return _flat(_run(fn, items)) if flatten else _run(fn, items)
        step = -(-len(items) // min(self.threads, len(items)))
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            pool = self._pool
        futures = [pool.submit(_run, fn, items[i : i + step]) for i in range(0, len(items), step)]
        results, error = [], None
        for future in futures:
            try:
                results.extend(future.result())
            except Exception as exc:  # noqa: BLE001 - re-raised after every slice is done
                error = error or exc
        if error is not None:
            raise error
        return _flat(results) if flatten else results

    def map_slices(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], page_bytes: int) -> list[R]:
        """``fn(items)`` with ``fn`` taking a batch: on the calling thread, or (pages of
        ``min_page_bytes`` or more) one contiguous slice per thread, results concatenated."""
        if len(items) < 2 or not self.parallel(page_bytes):
            return list(fn(items))
        return self.map(fn, _Slices(items, min(self.threads, len(items))), page_bytes, flatten=True)

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
