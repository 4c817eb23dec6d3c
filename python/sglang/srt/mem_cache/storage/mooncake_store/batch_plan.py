"""How a run of pages is handed to Mooncake: object names, each object's buffer list (its payload
chunks in host memory, then its trailer row) and the payload checksums.

A page of a registered pool is one store object (``per_component = False``), so a batch is a
list of objects in page order. With the native helper (``native_io.HASH``) and pools whose pages
are affine in their buffers, the buffers come from ``PoolCodec.object_iovecs`` in one numpy pass
and the payloads are hashed natively without the GIL; otherwise from each page's ``ObjectIO``
views, hashed by ``batch_trailers``. Trailer rows come from a registered :class:`TrailerArea`.

Small objects in one piece go through a registered :class:`StagingArea` instead: Mooncake moves
every buffer of an object as a TCP request of its own (about 55 us each, whatever its size), so
an object of one host chunk plus its trailer row costs two, while a copy of a page of at most
:data:`STAGE_MAX_PAYLOAD` bytes into ``payload || trailer`` in one staging slot costs less than
the second request (a 64 KiB page: about 10 us). A staged read is verified in the staging slot
and only then copied into the host page, so a page that fails never touches host memory.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np

from sglang.srt.mem_cache.storage import batch_trailers, native_io
from sglang.srt.mem_cache.storage.integrity import HEADER_BYTES
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO

TRAILER_BYTES = 64
# Objects of one host chunk and at most this many payload bytes are staged (see above): a copy
# of 128 KiB costs about the ~55 us of the trailer's own TCP request it saves.
STAGE_MAX_PAYLOAD = 128 << 10
STAGING_BYTES = 32 << 20  # per direction, allocated when a pool has objects to stage


class TrailerArea:
    """Rows of TRAILER_BYTES in page-aligned memory (registered with Mooncake), one per object
    of a batch call."""

    def __init__(self, rows: int):
        self._map = mmap.mmap(-1, rows * TRAILER_BYTES)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(rows, TRAILER_BYTES)
        self.address = self.rows.ctypes.data
        self.nbytes = self.rows.nbytes


class StagingArea:
    """Page-aligned memory (registered with Mooncake) holding ``payload || trailer`` of the
    staged objects of one batch call, back to back."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.bytes.ctypes.data
        self.nbytes = nbytes


def stages(nbytes: int, chunks: int) -> bool:
    """Whether an object of ``nbytes`` payload bytes in ``chunks`` host chunks is staged."""
    return chunks == 1 and 0 < nbytes <= STAGE_MAX_PAYLOAD


@dataclass
class Staged:
    """The staged objects of a batch: their indices, host payload addresses, payload lengths and
    offsets in the staging area."""

    index: np.ndarray  # int64, object indices in the batch
    host: np.ndarray  # int64
    lens: np.ndarray  # int64
    offsets: np.ndarray  # int64, payload start in the staging area (its trailer follows)
    area: StagingArea

    def tails(self) -> np.ndarray:
        """(n, TRAILER_BYTES) indices of the staged objects' trailers in ``area.bytes``."""
        return (self.offsets + self.lens)[:, None] + np.arange(TRAILER_BYTES, dtype=np.int64)[None, :]

    def fill(self) -> None:
        """Copy every staged payload from host memory into its staging slot (before a write)."""
        base, move = self.area.address, ctypes.memmove
        for host, off, n in zip(self.host.tolist(), self.offsets.tolist(), self.lens.tolist()):
            move(base + off, host, n)

    def deliver(self, keep: np.ndarray) -> None:
        """Copy the staged payloads where ``keep`` (bool per staged object) into host memory."""
        base, move = self.area.address, ctypes.memmove
        for host, off, n, k in zip(self.host.tolist(), self.offsets.tolist(), self.lens.tolist(), keep.tolist()):
            if k:
                move(host, base + off, n)


@dataclass
class Batch:
    pages: list[PageIO]
    names: list[str]
    ptrs: list[list[int]]  # per object: payload chunk addresses, then its trailer row
    sizes: list[list[int]]
    nbytes: list[int]  # payload bytes per object
    per_page: list[int]  # objects per page
    rows: np.ndarray  # the objects' trailer rows
    iov: native_io.Iovecs | None  # payload iovecs in transit (native hash), or None: ``objs`` views
    objs: list[ObjectIO] | None
    staged: Staged | None = None  # objects moved through a staging area (``iov`` points there)

    def poison(self) -> None:
        """Before a read: overwrite every trailer's header bytes, so that a short read cannot
        leave an earlier valid header behind."""
        self.rows[:, -HEADER_BYTES:] = 0xFF
        if self.staged is not None:
            self.staged.area.bytes[self.staged.tails()[:, -HEADER_BYTES:]] = 0xFF

    def set_trailers(self, trailers: np.ndarray) -> None:
        """Before a write: every object's trailer into its row, or its staging slot."""
        self.rows[:] = trailers
        if self.staged is not None:
            self.staged.area.bytes[self.staged.tails()] = trailers[self.staged.index]

    def take_trailers(self) -> None:
        """After a read: the staged objects' trailers into their rows (for :meth:`verified`)."""
        if self.staged is not None:
            self.rows[self.staged.index] = self.staged.area.bytes[self.staged.tails()]

    def deliver(self, good: list[bool]) -> None:
        """After a verified read: the staged objects that verified into host memory."""
        if self.staged is not None:
            self.staged.deliver(np.asarray(good, dtype=bool)[self.staged.index])

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


def plan(pages: list[PageIO], rows: np.ndarray, staging: StagingArea | None = None) -> Batch:
    """The batch of ``pages`` with trailer rows ``rows`` (one per object, C-contiguous); objects
    that :func:`stages` accepts go through ``staging`` while it has room."""
    layout = native_io.batch_layout(pages) if native_io.HASH else None
    if layout is not None:
        n = len(layout.names)
        iov, staged = layout.iov, None
        if staging is not None:
            iov, staged = _stage(iov, staging)
        full = iov.with_tails(rows[:n])
        if staged is not None:  # a staged object is one buffer: its payload and trailer, back to back
            full.lens[full.starts[staged.index]] += TRAILER_BYTES
            keep = np.ones(len(full.addrs), dtype=bool)
            keep[full.starts[staged.index] + 1] = False
            counts = np.diff(full.starts)
            counts[staged.index] -= 1
            full = native_io.Iovecs(full.addrs[keep], full.lens[keep],
                                    np.concatenate(([0], np.cumsum(counts))).astype(np.int64))
        bounds, addrs, lens = full.starts.tolist(), full.addrs.tolist(), full.lens.tolist()
        ptrs = [addrs[a:b] for a, b in zip(bounds, bounds[1:])]
        sizes = [lens[a:b] for a, b in zip(bounds, bounds[1:])]
        return Batch(pages, layout.names, ptrs, sizes, layout.nbytes.tolist(), layout.per_page, rows[:n],
                     iov, None, staged)
    objs = [o for p in pages for o in p.objects]
    rows = rows[: len(objs)]
    trailer_at = rows.ctypes.data
    ptrs = [[*o.ptrs, trailer_at + i * TRAILER_BYTES] for i, o in enumerate(objs)]
    sizes = [[v.nbytes for v in o.views] + [TRAILER_BYTES] for o in objs]
    return Batch(pages, [o.name for o in objs], ptrs, sizes, [o.nbytes for o in objs],
                 [len(p.names) for p in pages], rows, None, objs)


def _stage(iov: native_io.Iovecs, staging: StagingArea) -> tuple[native_io.Iovecs, Staged | None]:
    """``iov`` with the payloads of the objects to stage moved into ``staging`` (back to back,
    each followed by room for its trailer), as many as fit, and those objects."""
    counts = np.diff(iov.starts)
    first = iov.starts[:-1]
    one = np.flatnonzero(counts == 1)
    one_lens = iov.lens[first[one]]
    candidate = one[(one_lens > 0) & (one_lens <= STAGE_MAX_PAYLOAD)]
    if not len(candidate):
        return iov, None
    lens = iov.lens[first[candidate]]
    slot = lens + TRAILER_BYTES
    ends = np.cumsum(slot)
    fit = int(np.searchsorted(ends, staging.nbytes, side="right"))
    if fit == 0:
        return iov, None
    index, lens, slot, ends = candidate[:fit], lens[:fit], slot[:fit], ends[:fit]
    offsets = (ends - slot).astype(np.int64)
    host = iov.addrs[first[index]].copy()
    addrs = iov.addrs.copy()
    addrs[first[index]] = staging.address + offsets
    return (native_io.Iovecs(addrs, iov.lens, iov.starts),
            Staged(index.astype(np.int64), host, lens.astype(np.int64), offsets, staging))


def split(pages: list[PageIO], max_objects: int, max_staged: int = 0) -> list[list[PageIO]]:
    """Runs of consecutive pages of at most ``max_objects`` objects and, when ``max_staged``,
    of at most that many bytes of objects :func:`stages` accepts (payload and trailer)."""
    runs, run, objects, staged = [], [], 0, 0
    for page in pages:
        n = len(page.names)
        codec = page.codec
        k = codec.pages_per_key
        s = sum(seg.nbytes + TRAILER_BYTES for seg in codec.segments
                if stages(seg.nbytes, seg.num_chunks * k)) if max_staged and not codec.is_marker else 0
        if run and (objects + n > max_objects or staged + s > max_staged > 0):
            runs.append(run)
            run, objects, staged = [], 0, 0
        run.append(page)
        objects += n
        staged += s
    if run:
        runs.append(run)
    return runs
