"""The batch path of the NIXL POSIX backend: a chunk of zero-copy pages of one pool as arrays.

The per-object path (``HiCacheNixl._transfer_read`` / ``_write_chunk``) builds a Python object
per object (target, transfer item, descriptors), opens and closes each file from Python, and
verifies each object's trailer on its own. At 64 KiB pages that costs more than NIXL's copy.
Here a chunk is planned with numpy from ``PoolCodec.object_iovecs``: the files are opened,
closed and renamed in one native call each (``native_io``), the payloads hashed in one, the
descriptors built as arrays and the trailers checked in one comparison.

It takes the common case only: NIXL POSIX, one registered pool per chunk, zero-copy, the native
helper built. Everything unusual goes back to the per-object path, which isolates and explains
it: an absent or wrong-sized object (the page is left to it), a failed transfer (the chunk is
redone there page by page), a page that does not verify (re-read and classified there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from sglang.srt.mem_cache.storage import batch_trailers, native_io
from sglang.srt.mem_cache.storage.integrity import HEADER_BYTES
from sglang.srt.mem_cache.storage.native_io import BatchLayout
from sglang.srt.mem_cache.storage.posix_files import READ_FLAGS

CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def usable(backend, pages) -> bool:
    """Whether ``pages`` (one chunk) can take the batch path."""
    if not native_io.HASH or not pages:  # zero-copy below implies the POSIX plugin
        return False
    codec = pages[0].codec
    ctx = backend.contexts.get(codec.name)
    return ctx is not None and ctx.is_zero_copy and not codec.is_marker and all(p.codec is codec for p in pages)


def _descriptors(layout: BatchLayout, trailers: np.ndarray, fds: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """(dram (ptr, len, 0), storage (offset, len, fd), registrations) of every object: its
    payload iovecs at increasing file offsets, then its trailer row."""
    iov = layout.iov.with_tails(trailers)
    owner = np.repeat(np.arange(iov.objects, dtype=np.int64), np.diff(iov.starts))
    ends = np.cumsum(iov.lens)
    first_end = np.concatenate(([0], ends))[iov.starts[:-1]]  # bytes before each object's first iovec
    offsets = ends - iov.lens - first_end[owner]
    zeros = np.zeros_like(iov.lens)
    dram = np.stack([iov.addrs, iov.lens, zeros], axis=1).astype(np.uint64)
    storage = np.stack([offsets, iov.lens, fds[owner]], axis=1).astype(np.uint64)
    return dram, storage, [(0, 0, int(fd), "") for fd in fds.tolist()]


@dataclass
class ReadChunk:
    """A chunk read by :func:`read_chunk`: ``moved`` pages were transferred and wait for
    :func:`settle`; ``fallback`` pages go to the per-object path."""

    pages: list
    layout: BatchLayout | None
    trailers: np.ndarray | None
    moved: np.ndarray  # bool per page
    alt: bool
    failed_transfer: bool = False


def read_chunk(backend, pages: list, alt: bool, io=None) -> ReadChunk:
    """Open every object of ``pages``, read the whole ones in one transfer (through ``io``,
    default the backend's agent) into the host pool and the trailers into the (``alt``: second)
    get area."""
    codec = pages[0].codec
    ctx = backend.contexts[codec.name]
    layout = native_io.batch_layout(pages)
    none = np.zeros(len(pages), dtype=bool)
    if layout is None:
        return ReadChunk(pages, None, None, none, alt)
    area = ctx.get_area_alt if alt else ctx.get_area
    trailers = area.rows(len(layout.names))
    trailers[:, -HEADER_BYTES:] = 0xFF  # a short read cannot pass for a whole object
    fds, sizes = native_io.open_files(backend.side.paths(layout.names),
                                      READ_FLAGS | (os.O_DIRECT if ctx.direct else 0), 0)
    try:
        ok = layout.page_flags((fds >= 0) & (sizes == layout.nbytes + trailers.shape[1]))
        if not ok.any():
            return ReadChunk(pages, layout, trailers, ok, alt)
        sub = layout if ok.all() else layout.subset(ok)
        try:
            dram, storage, regs = _descriptors(sub, trailers[: len(sub.names)], fds[sub.object_index])
            (io or backend.io).transfer("READ", dram, storage, regs)
        except Exception:  # noqa: BLE001 - the per-object path redoes and explains it
            return ReadChunk(pages, layout, trailers, none, alt, failed_transfer=True)
        return ReadChunk(pages, sub, trailers[: len(sub.names)], ok, alt)
    finally:
        native_io.close_files(fds)


def settle(chunk: ReadChunk) -> np.ndarray:
    """Per page of the chunk: read and verified (hash of the payload in host memory, trailer
    equal to its one valid value)."""
    out = np.zeros(len(chunk.pages), dtype=bool)
    if not chunk.moved.any():
        return out
    layout = chunk.layout
    sums = native_io.hash_objects(layout.iov).tolist()
    digests = batch_trailers.digests(sums, layout.per_page)
    good = batch_trailers.verify(chunk.trailers, layout.names, layout.nbytes, sums, digests)
    out[chunk.moved] = layout.page_flags(good)
    return out


def write_chunk(backend, pages: list, alt: bool = False, io=None) -> list[bool] | None:
    """Write a chunk of pages: hash, trailers into the (``alt``: second) set area, every
    temporary file created in one call, one transfer (through ``io``, default the backend's
    agent), then (under the commit lock) every file renamed into place. None when the chunk must
    go to the per-object path (nothing of it is left on disk then)."""
    codec = pages[0].codec
    ctx, side = backend.contexts[codec.name], backend.side
    layout = native_io.batch_layout(pages)
    if layout is None:
        return None
    sums = native_io.hash_objects(layout.iov).tolist()
    digests = batch_trailers.digests(sums, layout.per_page)
    trailers = (ctx.set_area_alt if alt else ctx.set_area).rows(len(layout.names))
    trailers[:] = batch_trailers.build(layout.names, layout.nbytes, sums, digests, trailers.shape[1])
    finals = side.paths(layout.names)
    tag = side.tmp_names.tag()
    tmps = [f"{p}{tag}{i}" for i, p in enumerate(finals)]
    fds, _ = native_io.open_files(tmps, CREATE_FLAGS | (os.O_DIRECT if ctx.direct else 0), 0o644)
    opened = [t for t, fd in zip(tmps, fds.tolist()) if fd >= 0]
    try:
        if len(opened) < len(tmps):  # e.g. a bucket directory removed: the per-object path recreates it
            return None
        dram, storage, regs = _descriptors(layout, trailers, fds)
        try:
            (io or backend.io).transfer("WRITE", dram, storage, regs)
        except Exception:  # noqa: BLE001 - redone page by page by the per-object path
            return None
        native_io.close_files(fds)
        fds = None
        with side.commit_lock():
            errs = native_io.rename_files(tmps, finals)
        renamed = errs == 0
        opened = [t for t, r in zip(tmps, renamed.tolist()) if not r]
        flags = layout.page_flags(renamed)
        if not flags.all():  # a page with one object not renamed: drop the ones that were
            native_io.unlink_files([f for f, r, k in zip(finals, renamed.tolist(), np.repeat(flags, layout.per_page))
                                    if r and not k])
            backend.stats.add(failures=int((~flags).sum()))
        return flags.tolist()
    finally:
        if fds is not None:
            native_io.close_files(fds)
        native_io.unlink_files(opened)
