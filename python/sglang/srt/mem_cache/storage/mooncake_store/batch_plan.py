"""How a run of pages is handed to Mooncake: object names, each object's buffer list (its payload
chunks in host memory, then its trailer row) and the payload checksums.

A page of a registered pool is one store object (``per_component = False``), so a batch is a
list of objects in page order. With the native helper (``native_io.HASH``) and pools whose pages
are affine in their buffers, the buffers come from ``PoolCodec.object_iovecs`` in one numpy pass
and the payloads are hashed natively without the GIL; otherwise from each page's ``ObjectIO``
views, hashed by ``batch_trailers``. Trailer rows come from a registered :class:`TrailerArea`.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from sglang.srt.mem_cache.storage import batch_trailers, native_io
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO

TRAILER_BYTES = 64


class TrailerArea:
    """Rows of TRAILER_BYTES in page-aligned memory (registered with Mooncake), one per object
    of a batch call."""

    def __init__(self, rows: int):
        self._map = mmap.mmap(-1, rows * TRAILER_BYTES)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(rows, TRAILER_BYTES)
        self.address = self.rows.ctypes.data
        self.nbytes = self.rows.nbytes


@dataclass
class Batch:
    pages: list[PageIO]
    names: list[str]
    ptrs: list[list[int]]  # per object: payload chunk addresses, then its trailer row
    sizes: list[list[int]]
    nbytes: list[int]  # payload bytes per object
    per_page: list[int]  # objects per page
    rows: np.ndarray  # the objects' trailer rows
    iov: native_io.Iovecs | None  # payload iovecs (native hash), or None: ``objs`` views
    objs: list[ObjectIO] | None

    def checksums(self) -> list[int]:
        """Payload checksum of every object, from host memory."""
        if self.iov is not None:
            return native_io.hash_objects(self.iov).tolist()
        return batch_trailers.checksums([o.views for o in self.objs])

    def trailers(self, sums: list[int]) -> np.ndarray:
        digests = batch_trailers.digests(sums, self.per_page)
        return batch_trailers.build(self.names, self.nbytes, sums, digests, TRAILER_BYTES)

    def verified(self, sums: list[int]) -> list[bool]:
        """Per object: whether its trailer row holds exactly the trailer of the payload read."""
        digests = batch_trailers.digests(sums, self.per_page)
        return batch_trailers.verify(self.rows, self.names, self.nbytes, sums, digests).tolist()

    def page_flags(self, per_object: list[bool]) -> list[bool]:
        flags, i = [], 0
        for n in self.per_page:
            flags.append(all(per_object[i : i + n]))
            i += n
        return flags


def plan(pages: list[PageIO], rows: np.ndarray) -> Batch:
    """The batch of ``pages`` with trailer rows ``rows`` (one per object, C-contiguous)."""
    layout = native_io.batch_layout(pages) if native_io.HASH else None
    if layout is not None:
        n = len(layout.names)
        iov = layout.iov.with_tails(rows[:n])
        bounds, addrs, lens = iov.starts.tolist(), iov.addrs.tolist(), iov.lens.tolist()
        ptrs = [addrs[a:b] for a, b in zip(bounds, bounds[1:])]
        sizes = [lens[a:b] for a, b in zip(bounds, bounds[1:])]
        return Batch(pages, layout.names, ptrs, sizes, layout.nbytes.tolist(), layout.per_page, rows[:n],
                     layout.iov, None)
    objs = [o for p in pages for o in p.objects]
    rows = rows[: len(objs)]
    trailer_at = rows.ctypes.data
    ptrs = [[*o.ptrs, trailer_at + i * TRAILER_BYTES] for i, o in enumerate(objs)]
    sizes = [[v.nbytes for v in o.views] + [TRAILER_BYTES] for o in objs]
    return Batch(pages, [o.name for o in objs], ptrs, sizes, [o.nbytes for o in objs],
                 [len(p.names) for p in pages], rows, None, objs)


def split(pages: list[PageIO], max_objects: int) -> list[list[PageIO]]:
    """Runs of consecutive pages of at most ``max_objects`` objects."""
    runs, run, objects = [], [], 0
    for page in pages:
        n = len(page.names)
        if run and objects + n > max_objects:
            runs.append(run)
            run, objects = [], 0
        run.append(page)
        objects += n
    if run:
        runs.append(run)
    return runs
