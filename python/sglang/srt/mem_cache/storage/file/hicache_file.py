"""HiCacheFile: one file per page and pool under a directory (the embedded default backend).

A file is ``<root>/<name[:2]>/<name>.bin`` holding the flat page followed by a 64-byte integrity
trailer (``integrity.py``). Pages move between the host pool and the file with one ``pwritev``
/ ``preadv`` on views of host memory (no intermediate copy) and are hashed right after the read,
while still in the CPU cache. Writes go to a private temporary file that is renamed over the
final name, so concurrent writers of one key leave one whole page. A capacity cap
(``capacity_gb``) evicts least-recently-used files. Batches of pages of 1 MiB and more are
spread over ``io_threads`` threads (default 2), so that one page is hashed while the next is
copied (``page_workers.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading

from sglang.srt.mem_cache.storage.extra_config import ExtraKey, parse_keys
from sglang.srt.mem_cache.storage.file.lru_evictor import LRUEvictor
from sglang.srt.mem_cache.storage.integrity import pack_trailer, page_digest, page_is_whole, payload_checksum, read_trailer
from sglang.srt.mem_cache.storage.page_workers import PageWorkers
from sglang.srt.mem_cache.storage.paged_storage import PagedStorage
from sglang.srt.mem_cache.storage.posix_files import create_exclusive, make_buckets, open_read, unlink_quiet
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO, PoolCodec

logger = logging.getLogger(__name__)

TRAILER_BYTES = 64
SUFFIX = ".bin"
EXTRA_KEYS = (
    ExtraKey("storage_dir", str, "/tmp/hicache", env="SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"),
    ExtraKey("capacity_gb", float, 0.0, minimum=0.0, help="0: half the free space of the filesystem"),
    ExtraKey("io_threads", int, 2, minimum=1, help="threads moving pages of 1 MiB and more (page_workers.py)"),
)


class HiCacheFile(PagedStorage):
    object_format = f"file-page/t{TRAILER_BYTES}"
    per_component = False

    def __init__(self, storage_config, mem_pool_host=None):
        opts = parse_keys(storage_config.extra_config, EXTRA_KEYS, "file backend")
        self.root = os.path.abspath(opts["storage_dir"])
        os.makedirs(self.root, exist_ok=True)
        cap = int(opts["capacity_gb"] * (1 << 30)) or shutil.disk_usage(self.root).free // 2
        self.evictor = LRUEvictor(max(cap, 1))
        self._tmp_ids = itertools.count()
        self._pid = os.getpid()
        self.workers = PageWorkers(opts["io_threads"], "hicache-file")
        make_buckets(self.root)
        self._scan()
        logger.info("HiCacheFile: %s, capacity %.2f GiB (%d files present), %d I/O threads", self.root,
                    cap / (1 << 30), len(self.evictor), self.workers.threads)
        super().__init__(storage_config, mem_pool_host)

    # ---- paths --------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name}{SUFFIX}"

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
                elif ".tmp." in entry.name:
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
    def _exists_objects(self, codec: PoolCodec, names: list[str]) -> list[bool]:
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

    def _read_pages(self, pages: list[PageIO]) -> list[bool]:
        return self.workers.map(self._read_page, pages, _page_bytes(pages))

    def _read_page(self, page: PageIO) -> bool:
        results = []
        for obj in page.objects:
            result = self._read_object(obj)
            if result is None:
                return False
            results.append(result)
        if not page_is_whole(results):  # objects of two different writes of this page
            page.zero()
            for obj in page.objects:
                self._remove(obj.name, corrupt=True)
            return False
        for obj in page.objects:
            self.evictor.touch(obj.name)
        return True

    def _read_object(self, obj: ObjectIO) -> tuple[int, int] | None:
        """(checksum, page digest) of a verified object; None when absent or corrupt (removed).

        One ``preadv`` asks for one byte more than the object: a file of the wrong size, short
        or long, returns another count, so no fstat is needed. The payload is verified right
        after the read, while it is still in the CPU cache."""
        total = obj.nbytes + TRAILER_BYTES
        try:
            fd = open_read(self.path(obj.name))
        except FileNotFoundError:
            return None
        trailer = bytearray(TRAILER_BYTES + 1)
        tail = memoryview(trailer)
        try:
            ok = os.preadv(fd, [*obj.views, tail[:TRAILER_BYTES], tail[TRAILER_BYTES:]], 0) == total
        finally:
            os.close(fd)
        result = read_trailer(tail[:TRAILER_BYTES], obj.name, obj.views, obj.nbytes) if ok else None
        if result is None:
            for view in obj.views:  # no unverified byte stays in the host pool
                view.fill(0)
            self._remove(obj.name, corrupt=True)
        return result

    def _write_pages(self, pages: list[PageIO]) -> list[bool]:
        return self.workers.map(self._write_page, pages, _page_bytes(pages))

    def _write_page(self, page: PageIO) -> bool:
        checksums = [payload_checksum(obj.views) for obj in page.objects]
        digest = page_digest(checksums)
        return all(
            self._write_object(obj, [*obj.views, pack_trailer(obj.name, obj.nbytes, c, digest, TRAILER_BYTES)])
            for obj, c in zip(page.objects, checksums)
        )

    def _write_object(self, obj: ObjectIO, data: list) -> bool:
        victims = self.evictor.reserve(obj.name, obj.nbytes + TRAILER_BYTES)
        if victims is None:
            logger.warning("HiCacheFile: a %d-byte page exceeds the capacity cap", obj.nbytes)
            return False
        for victim in victims:
            unlink_quiet(self.path(victim))
        path = self.path(obj.name)
        tmp = f"{path}.tmp.{self._pid}.{threading.get_ident()}.{next(self._tmp_ids)}"
        try:
            fd = create_exclusive(tmp)
            try:
                _pwritev_all(fd, data, obj.nbytes + TRAILER_BYTES)
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
    def _close(self) -> None:
        self.workers.close()

    def clear(self) -> None:
        """Delete every page file under the root."""
        for bucket in os.scandir(self.root):
            if bucket.is_dir() and len(bucket.name) == 2:
                for entry in os.scandir(bucket.path):
                    if entry.name.endswith(SUFFIX):
                        unlink_quiet(entry.path)
        self.evictor.clear()


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
