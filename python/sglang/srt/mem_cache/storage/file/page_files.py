"""PageFiles: the file store behind HiCacheFile (``hicache_storage.py``), one file per page and
pool under a directory.

A file is ``<root>/<name[:2]>/<name>.bin`` holding the flat page followed by a 64-byte integrity
trailer (``integrity.py``). Pages move between the host pool and the file with one ``pwritev``
/ ``preadv`` on views of host memory (no intermediate copy) and are verified per batch: each
payload hashed once, then every trailer compared with its one valid value at once
(``batch_trailers.py``; hashing each page right after its read measured no faster at 64 KiB and
25% slower at 1 MiB). Writes go to a private temporary file that is renamed over the final
name, so concurrent writers of one key leave one whole page. A capacity cap
(``capacity_gb``) evicts least-recently-used files. Batches of pages of 1 MiB and more are
spread over ``io_threads`` threads (default 2), so that one page is hashed while the next is
copied (``page_workers.py``).

With the native helper built (``storage/native_io.py``) a batch is one call each way, without
the GIL: every file opened, read (payload straight into host memory, then the trailer plus one
byte) and closed, and each payload hashed right after its read, while it is still in the cache;
writes hash the batch in one call, then create, write, close and rename every file in another.
Pages that fail the batch check, and writes whose bucket directory has gone, go through the
per-object Python path below, which classifies or repairs them. At 64 KiB pages this moved the
file backend's get from 0.52x to 0.65-0.71x of plain ``preadv`` (``bench_storage.py``). As a
native slice holds the GIL only for its bookkeeping, batches of pages from 32 KiB are then
spread over the threads too: 64 KiB gets 0.62-0.68x on one thread, 0.86-0.99x on two.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil

import numpy as np

from sglang.srt.mem_cache.storage.extra_config import ExtraKey, parse_keys
from sglang.srt.mem_cache.storage.file.lru_evictor import LRUEvictor
from sglang.srt.mem_cache.storage import batch_trailers, native_io
from sglang.srt.mem_cache.storage.integrity import page_is_whole, read_trailer
from sglang.srt.mem_cache.storage.page_workers import (
    NATIVE_PARALLEL_MIN_PAGE_BYTES,
    PARALLEL_MIN_PAGE_BYTES,
    PageWorkers,
)
from sglang.srt.mem_cache.storage.posix_files import (
    READ_FLAGS,
    TempNames,
    create_exclusive,
    open_read,
    prepare_root,
    unlink_quiet,
)
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO, PoolCodec
from sglang.srt.mem_cache.storage.stats import StorageStats
from sglang.srt.utils.private_dir import user_private_dir

logger = logging.getLogger(__name__)

TRAILER_BYTES = 64
SUFFIX = ".bin"
OBJECT_FORMAT = f"file-page/t{TRAILER_BYTES}"
DEFAULT_STORAGE_DIR_NAME = "hicache"  # the default: <tempdir>/hicache-<uid>, private (user_private_dir)
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
ALIASES = {"file_storage_path": "storage_dir"}  # upstream's spelling
EXTRA_KEYS = (
    ExtraKey("storage_dir", str, "", env=STORAGE_DIR_ENV, help="default: <tempdir>/hicache-<uid>, created 0700"),
    ExtraKey("capacity_gb", float, 0.0, minimum=0.0, help="0: half the free space of the filesystem"),
    ExtraKey("io_threads", int, 2, minimum=1,
             help="threads moving a batch: pages of 1 MiB and more, or 32 KiB and more with the native helper "
                  "(page_workers.py)"),
)


def parse_file_options(extra_config: dict, file_path: str | None = None) -> dict:
    """The file backend's options: extra config keys (``storage_dir``, or upstream's
    ``file_storage_path``), else their environment variables, else defaults; ``file_path``
    (upstream's constructor argument) is the directory's default."""
    extra = dict(extra_config)
    for old, new in ALIASES.items():
        if old in extra:
            if new in extra:
                raise ValueError(f"file backend: extra config keys {old!r} and {new!r} are the same setting; give one")
            extra[new] = extra.pop(old)
    keys = EXTRA_KEYS
    if file_path:
        keys = tuple(ExtraKey(k.name, k.type, file_path, k.env) if k.name == "storage_dir" else k for k in keys)
    return parse_keys(extra, keys, "file backend")


class PageFiles:
    """Stores, reads and verifies the objects of PageIO batches as files under ``root``.
    ``stats``: the backend's counters (corruptions, failures)."""

    def __init__(self, opts: dict, stats: StorageStats):
        self.stats = stats
        self.root = os.path.abspath(opts["storage_dir"] or user_private_dir(DEFAULT_STORAGE_DIR_NAME))
        self.read_only = not prepare_root(self.root, "file backend", "storage_dir")
        if self.read_only:
            logger.warning("HiCacheFile: %s is not writable: serving reads only, every set is a miss", self.root)
        cap = int(opts["capacity_gb"] * (1 << 30)) or shutil.disk_usage(self.root).free // 2
        self.evictor = LRUEvictor(max(cap, 1))
        self.tmp_names = TempNames()
        # With the native helper a batch slice holds the GIL only for its bookkeeping, so
        # slices of small pages overlap too (page_workers.py).
        self.workers = PageWorkers(opts["io_threads"], "hicache-file",
                                   NATIVE_PARALLEL_MIN_PAGE_BYTES if native_io.HASH else PARALLEL_MIN_PAGE_BYTES)
        self._scan()
        logger.info("HiCacheFile: %s, capacity %.2f GiB (%d files present), %d I/O threads", self.root,
                    cap / (1 << 30), len(self.evictor), self.workers.threads)

    # ---- paths --------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name}{SUFFIX}"

    def paths(self, names: list[str]) -> list[str]:
        root = self.root
        return [f"{root}/{n[:2]}/{n}{SUFFIX}" for n in names]

    def _scan(self) -> None:
        """Account the files already there, oldest first, and drop leftover temporary files."""
        found = []
        for bucket in os.scandir(self.root):
            if not bucket.is_dir() or len(bucket.name) != 2:
                continue
            for entry in os.scandir(bucket.path):
                if entry.name.endswith(SUFFIX):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[: -len(SUFFIX)], st.st_size))
                elif ".tmp." in entry.name and not self.read_only:
                    unlink_quiet(entry.path)
        for _, name, size in sorted(found):
            self.evictor.reserve(name, size)

    def _remove(self, name: str, corrupt: bool) -> None:
        unlink_quiet(self.path(name))
        self.evictor.forget(name)
        if corrupt:
            self.stats.add(corruptions=1)
            logger.warning("HiCacheFile: %s failed its integrity check; removed", name)

    # ---- primitives ---------------------------------------------------------------------
    def exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
        sizes = [s.nbytes + TRAILER_BYTES for s in codec.segments] * (len(names) // len(codec.segments))
        out = []
        for name, size in zip(names, sizes):
            try:
                actual = os.stat(self.path(name)).st_size
            except FileNotFoundError:
                out.append(False)
                continue
            if actual != size:  # truncated or zero-length
                self._remove(name, corrupt=True)
            out.append(actual == size)
        return out

    def read_pages(self, pages: list[PageIO]) -> list[bool]:
        return self.workers.map_slices(self._read_batch, pages, _page_bytes(pages))

    def _read_batch(self, pages: list[PageIO]) -> list[bool]:
        return _native_or_python(pages, self._read_native, self._read_python)

    def _read_native(self, pages: list[PageIO], layout: native_io.BatchLayout) -> list[bool]:
        """:meth:`_read_python` in one native call: every object opened, read (payload and one
        byte more than its trailer) and hashed while still in the cache, without the GIL. Pages
        that fail the batch check go through :meth:`_settle_page`."""
        names = layout.names
        tails = np.empty((len(names), TRAILER_BYTES + 1), dtype=np.uint8)
        counts, sums = native_io.read_files(self.paths(names), READ_FLAGS, layout.iov, tails, TRAILER_BYTES)
        whole = counts == layout.nbytes + TRAILER_BYTES
        sums_list = sums.tolist()
        digests = batch_trailers.digests(sums_list, layout.per_page)
        good = batch_trailers.verify(tails[:, :TRAILER_BYTES], names, layout.nbytes, sums_list, digests) & whole
        flags = layout.page_flags(good).tolist()
        if all(flags):
            self.evictor.touch_many(names)
            return flags
        counts[counts < 0] = -1  # absent or not openable: a miss, left alone
        touched = []
        for k, (page, ok) in enumerate(zip(pages, flags)):
            i, n = int(layout.first[k]), layout.per_page[k]
            if ok:
                touched.extend(names[i : i + n])
            else:
                flags[k] = self._settle_page(page, counts[i : i + n].tolist(), tails[i : i + n])
        self.evictor.touch_many(touched)
        return flags

    def _read_python(self, pages: list[PageIO]) -> list[bool]:
        """Read every object of ``pages``, then verify them all at once (``batch_trailers``).

        One ``preadv`` per object asks for one byte more than the object: a file of the wrong
        size, short or long, returns another count, so no fstat is needed. A page whose objects
        do not all match their one valid trailer goes through :meth:`_settle_page`."""
        objs = [o for p in pages for o in p.objects]
        width = TRAILER_BYTES + 1
        tails = np.empty((len(objs), width), dtype=np.uint8)
        tail_views = memoryview(tails.reshape(-1))
        counts = [-1] * len(objs)  # -1: absent
        preadv, close, os_open = os.preadv, os.close, os.open
        root, end = self.root, 0
        for i, obj in enumerate(objs):
            name, views, start = obj.name, obj.views, end
            end += width
            path = f"{root}/{name[:2]}/{name}{SUFFIX}"
            try:
                fd = os_open(path, READ_FLAGS)
            except FileNotFoundError:
                continue
            except PermissionError:  # O_NOATIME on a file of another owner
                fd = open_read(path)
            try:
                counts[i] = preadv(fd, [*views, tail_views[start:end]], 0)
            finally:
                close(fd)
        whole = [c == o.nbytes + TRAILER_BYTES for c, o in zip(counts, objs)]
        sums = batch_trailers.checksums([o.views if w else () for o, w in zip(objs, whole)])
        digests = batch_trailers.digests(sums, [len(p.objects) for p in pages])
        expected = batch_trailers.build([o.name for o in objs], [o.nbytes for o in objs], sums, digests, TRAILER_BYTES)
        good = (batch_trailers.matches(tails[:, :TRAILER_BYTES], expected) & np.array(whole, dtype=bool)).tolist()
        flags, i, touched = [], 0, []
        for page in pages:
            n = len(page.objects)
            if all(good[i : i + n]):
                flags.append(True)
                touched.extend(o.name for o in page.objects)
            else:
                flags.append(self._settle_page(page, counts[i : i + n], tails[i : i + n]))
            i += n
        self.evictor.touch_many(touched)
        return flags

    def _settle_page(self, page: PageIO, counts: list[int], tails: np.ndarray) -> bool:
        """A page that failed the batch check, object by object: absent (a miss, untouched),
        corrupt (zeroed and removed) or whole objects of two different page writes (all
        removed). Whatever was read into host memory is wiped unless the page verifies."""
        results = []
        for obj, count, tail in zip(page.objects, counts, tails):
            if count == -1:
                results = None
                break
            whole = count == obj.nbytes + TRAILER_BYTES
            result = read_trailer(tail[:TRAILER_BYTES], obj.name, obj.views, obj.nbytes) if whole else None
            if result is None:
                self._remove(obj.name, corrupt=True)
                results = None
                break
            results.append(result)
        if results is not None and page_is_whole(results):
            self.evictor.touch_many([o.name for o in page.objects])
            return True
        if results is not None:  # whole objects of two different writes of this page
            for obj in page.objects:
                self._remove(obj.name, corrupt=True)
        for obj, count in zip(page.objects, counts):
            if count != -1:  # no unverified byte stays in the host pool
                for view in obj.views:
                    view.fill(0)
        return False

    def write_pages(self, pages: list[PageIO]) -> list[bool]:
        if self.read_only:
            return [False] * len(pages)
        return self.workers.map_slices(self._write_batch, pages, _page_bytes(pages))

    def _write_batch(self, pages: list[PageIO]) -> list[bool]:
        return _native_or_python(pages, self._write_native, self._write_python)

    def _write_native(self, pages: list[PageIO], layout: native_io.BatchLayout) -> list[bool]:
        """:meth:`_write_python` with the hashing and the file work of the whole batch in two
        native calls. A page whose write failed because its bucket directory is gone is
        retried by the Python path (which recreates it)."""
        names = layout.names
        sums = native_io.hash_objects(layout.iov).tolist()
        digests = batch_trailers.digests(sums, layout.per_page)
        trailers = batch_trailers.build(names, layout.nbytes, sums, digests, TRAILER_BYTES)
        sizes = (layout.nbytes + TRAILER_BYTES).tolist()
        fits = self.evictor.reserve_many(names, sizes, self._evict)
        todo = layout if all(fits) else layout.subset(layout.page_flags(np.asarray(fits, dtype=bool)))
        finals = self.paths(todo.names)
        tag = self.tmp_names.tag()
        tmps = [f"{p}{tag}{i}" for i, p in enumerate(finals)]
        errs = np.full(len(names), -errno.EFBIG, dtype=np.int64)
        rows = trailers if todo is layout else trailers[todo.object_index]
        errs[todo.object_index] = native_io.write_files(tmps, finals, 0, todo.iov.with_tails(rows))
        ok = errs == 0
        flags = layout.page_flags(ok).tolist()
        if all(flags):
            return flags
        retry = []
        for k, page in enumerate(pages):
            i, n = int(layout.first[k]), layout.per_page[k]
            for j in range(i, i + n):
                if not ok[j]:
                    self.evictor.forget(names[j])
            if flags[k]:
                continue
            if (errs[i : i + n] == native_io.ENOENT).any():
                retry.append(k)
            elif (errs[i : i + n] == -errno.EFBIG).any():
                logger.warning("HiCacheFile: a %d-byte page does not fit the capacity cap", page.nbytes)
            else:
                self.stats.add(failures=1)
                logger.warning("HiCacheFile: writing %s failed: %s", names[i], os.strerror(int(-errs[i:i + n].min())))
        if retry:
            for k, again in zip(retry, self._write_python([pages[k] for k in retry])):
                flags[k] = again
        return flags

    def _evict(self, victims: list[str]) -> None:
        native_io.unlink_files([self.path(v) for v in victims])

    def _write_python(self, pages: list[PageIO]) -> list[bool]:
        """Checksums and trailers of the whole batch first (``batch_trailers``), then one
        private temporary file per object, renamed over its final name."""
        objs = [o for p in pages for o in p.objects]
        sums = batch_trailers.checksums([o.views for o in objs])
        digests = batch_trailers.digests(sums, [len(p.objects) for p in pages])
        trailers = batch_trailers.build([o.name for o in objs], [o.nbytes for o in objs], sums, digests, TRAILER_BYTES)
        tmp_tag = self.tmp_names.tag()
        flags, i = [], 0
        for page in pages:
            ok = True
            for obj in page.objects:
                ok = ok and self._write_object(obj, [*obj.views, trailers[i]], f"{tmp_tag}{i}")
                i += 1
            flags.append(ok)
        return flags

    def _write_object(self, obj: ObjectIO, data: list, tmp_suffix: str) -> bool:
        total = obj.nbytes + TRAILER_BYTES
        victims = self.evictor.reserve(obj.name, total)
        if victims is None:
            logger.warning("HiCacheFile: a %d-byte page exceeds the capacity cap", obj.nbytes)
            return False
        for victim in victims:
            unlink_quiet(self.path(victim))
        name = obj.name
        path = f"{self.root}/{name[:2]}/{name}{SUFFIX}"
        tmp = f"{path}{tmp_suffix}"
        try:
            fd = create_exclusive(tmp)
            try:
                _pwritev_all(fd, data, total)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            unlink_quiet(tmp)
            self.evictor.forget(obj.name)
            self.stats.add(failures=1)
            logger.warning("HiCacheFile: writing %s failed", obj.name, exc_info=True)
            return False
        return True

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        self.workers.close()

    def clear(self) -> None:
        """Delete every page file under the root."""
        for bucket in os.scandir(self.root):
            if bucket.is_dir() and len(bucket.name) == 2:
                for entry in os.scandir(bucket.path):
                    if entry.name.endswith(SUFFIX):
                        unlink_quiet(entry.path)
        self.evictor.clear()


def _native_or_python(pages: list[PageIO], native, python) -> list[bool]:
    """``native(pages, layout)`` when the native helper hashes and the pages have a batch layout
    (``native_io``), else ``python(pages)``."""
    layout = native_io.batch_layout(pages) if native_io.HASH else None
    return python(pages) if layout is None else native(pages, layout)


def _page_bytes(pages: list[PageIO]) -> int:
    return pages[0].nbytes if pages else 0


def _pwritev_all(fd: int, buffers: list, total: int) -> None:
    """pwritev ``total`` bytes at offset 0, continuing after short writes."""
    n = os.pwritev(fd, buffers, 0)
    if n == total:
        return
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
        if views:
            n = os.pwritev(fd, views, offset)
