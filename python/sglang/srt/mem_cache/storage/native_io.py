"""Batched file I/O for the L3 backends through the optional native helper (``csrc/native_files.c``).

The file backend reads and writes a whole batch of page files in one call each (open, one
``preadv``/``pwritev``, close, rename), and hashes every payload with XXH3-64 right after it is
read, all without the GIL. The NIXL backend opens, closes and renames its batch's files in one
call each. Object memory is passed as :class:`Iovecs` (flat int64 arrays built by
``PoolCodec.object_iovecs``), never as per-object Python objects.

``AVAILABLE`` says whether the helper is built; ``HASH`` whether it also hashes (the xxhash
package is installed, its compiled XXH3 functions could be bound, and they agree with
``xxhash.xxh3_64_intdigest`` on a self-test). Callers keep their Python paths for when either
is False.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import numpy as np

from sglang.srt.mem_cache.storage.integrity import DEFAULT_CHECKSUM, Checksum, xxhash

logger = logging.getLogger(__name__)

try:
    from sglang.srt.mem_cache.storage import _native_files as _nf
except ImportError:  # built by python/setup.py when a C compiler is present
    _nf = None

AVAILABLE = _nf is not None
ENOENT = -errno.ENOENT


def _bind_hash() -> bool:
    if _nf is None or xxhash is None or DEFAULT_CHECKSUM is not Checksum.XXH3_64:
        return False
    try:
        import xxhash._xxhash as compiled

        _nf.bind_xxh3(compiled.__file__)
        sample = np.frombuffer(bytes(range(256)) * 97, dtype=np.uint8)
        out = np.zeros(3, dtype=np.uint64)
        addrs = np.array([sample.ctypes.data, sample.ctypes.data + 1000, sample.ctypes.data + 5], dtype=np.int64)
        lens = np.array([sample.size, 3000, 77], dtype=np.int64)
        _nf.hash_iovs(addrs, lens, np.array([0, 1, 3, 3], dtype=np.int64), out)
        want = [xxhash.xxh3_64_intdigest(sample), xxhash.xxh3_64_intdigest(bytes(sample[1000:4000]) + bytes(sample[5:82])),
                xxhash.xxh3_64_intdigest(b"")]
        if out.tolist() != want:
            logger.warning("native XXH3 disagrees with the xxhash package; storage hashes in Python")
            return False
        return True
    except (ImportError, OSError, AttributeError) as exc:
        logger.info("native XXH3 unavailable (%s); storage hashes in Python", exc)
        return False


HASH = _bind_hash()


@dataclass
class Iovecs:
    """Host memory of a batch of objects: iovec ``addrs``/``lens`` (int64) and ``starts``
    (object i owns iovecs starts[i] .. starts[i + 1])."""

    addrs: np.ndarray
    lens: np.ndarray
    starts: np.ndarray

    @property
    def objects(self) -> int:
        return len(self.starts) - 1

    def with_tails(self, tails: np.ndarray) -> Iovecs:
        """These iovecs with row i of ``tails`` (a C-contiguous 2-D uint8 array) appended to object i."""
        n, iov = self.objects, len(self.addrs)
        owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(self.starts))
        tail_at = self.starts[1:] + np.arange(n, dtype=np.int64)
        addrs = np.empty(iov + n, dtype=np.int64)
        lens = np.empty(iov + n, dtype=np.int64)
        moved = np.arange(iov, dtype=np.int64) + owner  # each payload iovec, shifted past earlier tails
        addrs[moved] = self.addrs
        lens[moved] = self.lens
        addrs[tail_at] = tails.ctypes.data + np.arange(n, dtype=np.int64) * tails.strides[0]
        lens[tail_at] = tails.shape[1]
        return Iovecs(addrs, lens, self.starts + np.arange(n + 1, dtype=np.int64))

    @staticmethod
    def concat(parts: list[Iovecs]) -> Iovecs:
        if len(parts) == 1:
            return parts[0]
        starts, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            starts.append(p.starts[1:] + base)
            base += len(p.addrs)
        return Iovecs(np.concatenate([p.addrs for p in parts]), np.concatenate([p.lens for p in parts]),
                      np.concatenate(starts))


def hash_objects(iov: Iovecs) -> np.ndarray:
    """XXH3-64 of each object's payload (uint64)."""
    out = np.empty(iov.objects, dtype=np.uint64)
    _nf.hash_iovs(iov.addrs, iov.lens, iov.starts, out)
    return out


def read_files(paths: list[str], flags: int, iov: Iovecs, tails: np.ndarray, trailer_bytes: int,
               hash: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Read each path into its object's iovecs and then row i of ``tails`` (a C-contiguous 2-D
    uint8 array). (counts: bytes read or -errno, sums: XXH3 of whole objects else 0)."""
    if tails.shape[0] != len(paths) or not tails.flags.c_contiguous or tails.dtype != np.uint8:
        raise ValueError("tails must be a C-contiguous uint8 array with one row per path")
    counts = np.empty(len(paths), dtype=np.int64)
    sums = np.empty(len(paths), dtype=np.uint64)
    _nf.read_files(paths, flags, iov.addrs, iov.lens, iov.starts, tails.ctypes.data, tails.strides[0],
                   tails.shape[1], trailer_bytes, hash and HASH, counts, sums)
    return counts, sums


def write_files(tmp_paths: list[str], final_paths: list[str], flags: int, iov: Iovecs) -> np.ndarray:
    """Create each temporary file, write its object's iovecs, rename it over its final path.
    Per object: 0 or -errno (the temporary file is gone then)."""
    errs = np.empty(len(tmp_paths), dtype=np.int64)
    _nf.write_files(tmp_paths, final_paths, flags, iov.addrs, iov.lens, iov.starts, errs)
    return errs


def open_files(paths: list[str], flags: int, mode: int = 0o644) -> tuple[np.ndarray, np.ndarray]:
    """(fds or -errno, sizes or -1) of each path."""
    fds = np.empty(len(paths), dtype=np.int64)
    sizes = np.empty(len(paths), dtype=np.int64)
    _nf.open_files(paths, flags, mode, fds, sizes)
    return fds, sizes


def close_files(fds: np.ndarray) -> None:
    _nf.close_files(np.ascontiguousarray(fds, dtype=np.int64))


def rename_files(src: list[str], dst: list[str]) -> np.ndarray:
    errs = np.empty(len(src), dtype=np.int64)
    _nf.rename_files(src, dst, errs)
    return errs


def unlink_files(paths: list[str]) -> None:
    if paths:
        _nf.unlink_files(paths)


@dataclass
class BatchLayout:
    """Every object of a batch of pages (PageIO, of any registered pools), page after page."""

    iov: Iovecs
    names: list[str]
    nbytes: np.ndarray  # payload bytes per object (int64)
    per_page: list[int]  # objects per page
    first: np.ndarray  # index of each page's first object (int64)
    index: np.ndarray | None = None  # for a subset: each object's index in the full layout

    @property
    def object_index(self) -> np.ndarray:
        return np.arange(len(self.names), dtype=np.int64) if self.index is None else self.index

    def subset(self, keep: np.ndarray) -> BatchLayout:
        """The layout of the pages where ``keep`` (bool per page) is True."""
        keep_obj = np.repeat(keep, self.per_page)
        idx = np.flatnonzero(keep_obj)
        counts = np.diff(self.iov.starts)
        keep_iov = np.repeat(keep_obj, counts)
        starts = np.concatenate(([0], np.cumsum(counts[idx]))).astype(np.int64)
        per_page = [n for n, k in zip(self.per_page, keep.tolist()) if k]
        iov = Iovecs(self.iov.addrs[keep_iov], self.iov.lens[keep_iov], starts)
        return BatchLayout(iov, [self.names[i] for i in idx.tolist()], self.nbytes[idx], per_page,
                           _first_objects(per_page), self.object_index[idx])

    def page_flags(self, good: np.ndarray) -> np.ndarray:
        """Per page: whether every one of its objects is ``good`` (bool per object)."""
        if not len(self.per_page):
            return np.zeros(0, dtype=bool)
        return np.logical_and.reduceat(good, self.first) if len(good) else np.ones(len(self.per_page), dtype=bool)


def batch_layout(pages) -> BatchLayout | None:
    """The layout of ``pages``, or None when a pool's pages are not affine in its buffers or one
    has a page without objects (the callers' per-object paths handle those)."""
    parts, nbytes, per_page, names = [], [], [], []
    i = 0
    while i < len(pages):
        codec, j = pages[i].codec, i
        while j < len(pages) and pages[j].codec is codec:
            j += 1
        iov = codec.object_iovecs([s for p in pages[i:j] for s in p.slots])
        if iov is None:
            return None
        parts.append(Iovecs(*iov))
        seg = [s.nbytes for s in codec.segments]
        nbytes.append(np.tile(np.asarray(seg, dtype=np.int64), j - i))
        per_page.extend([len(seg)] * (j - i))
        for p in pages[i:j]:
            names.extend(p.names)
        i = j
    if not parts:
        return None
    return BatchLayout(Iovecs.concat(parts), names, np.concatenate(nbytes), per_page, _first_objects(per_page))


def _first_objects(per_page: list[int]) -> np.ndarray:
    """Index of each page's first object, given the objects per page (int64)."""
    return np.concatenate(([0], np.cumsum(per_page, dtype=np.int64)[:-1])).astype(np.int64)
