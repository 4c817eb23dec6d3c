"""The storage side of a NIXL transfer: files for the POSIX plugin (:class:`NixlFileManager`,
upstream's name), objects for the OBJ plugin (:class:`NixlObjStore`).

Each side turns an object name into a NIXL device id + metadata for one transfer and makes
writes atomic: POSIX writes a private temporary file and renames it over the final name; an
S3 PUT is atomic by itself. Files live at ``<base_dir>/<bucket>/<name>``, the base directory and
bucket chosen from the name's page group (``nixl_routing.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass

from sglang.srt.mem_cache.storage.nixl.nixl_config import NixlOptions
from sglang.srt.mem_cache.storage.nixl.nixl_routing import BUCKET_HEX_CHARS, route_key
from sglang.srt.mem_cache.storage.posix_files import CommitLock, TempNames, create_exclusive, open_read, prepare_root, unlink_quiet

logger = logging.getLogger(__name__)

ALIGN = 4096


@dataclass
class Target:
    name: str
    dev_id: int
    meta: str  # metaInfo NIXL registers the device id with ("" for files, the key for objects)
    tmp_path: str = ""

    @property
    def reg(self) -> tuple[int, int, int, str]:
        return (0, 0, self.dev_id, self.meta)


class NixlFileManager:
    """Files under one or more base directories; the device id is an open file descriptor.

    ``get_file_path`` places an object at ``<base_dirs[disk]>/<bucket>/<name>`` by its page
    group (``nixl_routing.route_key``), so every object of one key shares a bucket of one disk,
    and a store reopened with the same directories finds every page. A directory that cannot be
    written (read-only mount or mode) makes the store read-only: reads are served, writes miss
    (``read_only``). ``use_direct_io`` asks for O_DIRECT; when a directory's filesystem refuses
    it (tmpfs, for one) the manager warns once and uses buffered I/O (``use_direct_io`` False).
    """

    ROUTE_CACHE = 1 << 17  # object paths (~25 MiB at most)

    def __init__(self, base_dir: list[str] | str, use_direct_io: bool = True, key: str = "storage_dir"):
        dirs = [base_dir] if isinstance(base_dir, str) else list(base_dir)
        if not dirs or any(not isinstance(d, str) or not d for d in dirs):
            raise ValueError(f"nixl backend: extra config key {key!r} needs one or more non-empty directories, "
                             f"got {base_dir!r}")
        self.base_dirs = [os.path.abspath(d) for d in dirs]
        self.root = self.base_dirs[0]
        writable = [prepare_root(r, "nixl backend", key) for r in self.base_dirs]
        self.read_only = not all(writable)
        if self.read_only:
            logger.warning("HiCacheNixl: %s not writable: serving reads only, every set is a miss",
                           ", ".join(r for r, w in zip(self.base_dirs, writable) if not w))
        # A read-only store cannot be probed (the probe writes): it reads buffered, already warned.
        self.use_direct_io = bool(use_direct_io) and hasattr(os, "O_DIRECT") and not self.read_only
        if self.use_direct_io and not all(probe_direct_io(r) for r in self.base_dirs):
            logger.warning("HiCacheNixl: O_DIRECT was asked for but %s does not support it; using buffered I/O",
                           ", ".join(self.base_dirs))
            self.use_direct_io = False
        self.tmp_names = TempNames()
        self._commit_lock = None if self.read_only else CommitLock(self.root)
        self._routes: dict[str, str] = {}  # object name -> its path

    def commit_lock(self):
        """Held while a batch of written objects is renamed into place (see CommitLock)."""
        return contextlib.nullcontext() if self._commit_lock is None else self._commit_lock.held()

    def close(self) -> None:
        if self._commit_lock is not None:
            self._commit_lock.close()

    # ---- paths (upstream's names) -------------------------------------------------------
    def iter_all_base_dirs(self) -> list[str]:
        return list(self.base_dirs)

    def get_file_path(self, key: str) -> str:
        """Where object ``key`` lives (a bounded cache: the batch paths ask for every object
        of a chunk, usually right after an existence check asked for the same ones)."""
        path = self._routes.get(key)
        if path is None:
            disk, bucket = route_key(key, len(self.base_dirs))
            path = f"{self.base_dirs[disk]}/{bucket}/{key}"
            if len(self._routes) >= self.ROUTE_CACHE:
                self._routes.clear()  # cheaper than LRU upkeep on every lookup; refills at once
            self._routes[key] = path
        return path

    def paths(self, names: list[str]) -> list[str]:
        get = self._routes.get
        return [get(n) or self.get_file_path(n) for n in names]

    def open_file(self, file_path: str, create: bool = False) -> int | None:
        """An fd of ``file_path`` opened read-write (``create``: created if absent, its bucket
        directory too), with O_DIRECT when ``use_direct_io``; None when it cannot be opened."""
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_DIRECT if self.use_direct_io else 0)
        try:
            if create:
                os.makedirs(os.path.dirname(file_path), exist_ok=True)
            return os.open(file_path, flags, 0o644)
        except OSError as exc:
            logger.debug("HiCacheNixl: cannot open %s: %s", file_path, exc)
            return None

    @staticmethod
    def close_file(fd: int) -> bool:
        try:
            os.close(fd)
            return True
        except OSError:
            return False

    def sizes(self, io, names: list[str]) -> list[int | None]:
        """Stored size of each object (None when absent)."""
        infos = io.query([(0, 0, 0, p) for p in self.paths(names)])
        return [None if info is None else _size(info) for info in infos]

    def stored_size(self, name: str) -> int | None:
        try:
            return os.stat(self.get_file_path(name)).st_size
        except FileNotFoundError:
            return None

    def open_read(self, name: str, direct: bool) -> tuple[Target | None, int | None]:
        """(target, stored size); (None, None) when absent."""
        try:
            fd = open_read(self.get_file_path(name), os.O_DIRECT if direct else 0)
        except FileNotFoundError:
            return None, None
        return Target(name, fd, ""), os.fstat(fd).st_size

    def open_write(self, name: str, direct: bool) -> Target:
        path = self.get_file_path(name)
        tmp = f"{path}{self.tmp_names.tag()}0"
        return Target(name, create_exclusive(tmp, os.O_DIRECT if direct else 0), "", tmp)

    def finish(self, target: Target, commit: bool) -> None:
        """Close; a write is renamed into place when ``commit``, else its temp file removed."""
        os.close(target.dev_id)
        if target.tmp_path:
            if commit:
                os.replace(target.tmp_path, self.get_file_path(target.name))
            else:
                unlink_quiet(target.tmp_path)

    def remove(self, name: str) -> None:
        unlink_quiet(self.get_file_path(name))

    def buckets(self):
        """Every bucket directory of every base directory (DirEntry)."""
        for root in self.base_dirs:
            for bucket in os.scandir(root):
                if bucket.is_dir() and len(bucket.name) == BUCKET_HEX_CHARS:
                    yield bucket

    def clear(self) -> None:
        """Remove every object (and leftover temporary file) below every base directory."""
        for bucket in self.buckets():
            for entry in os.scandir(bucket.path):
                unlink_quiet(entry.path)


def _size(info) -> int:
    """The stored size a NIXL query reports (-1: present, size unknown)."""
    return int(info.get("size", -1)) if isinstance(info, dict) else -1


class NixlObjStore:
    """Objects in one bucket; the device id is a process-unique number bound to the key."""

    use_direct_io = False
    read_only = False

    def __init__(self, options: NixlOptions):
        self.params = options.plugin_params
        self.timeout_s = options.transfer_timeout_s
        self._ids = itertools.count(1)
        self._client = None

    def sizes(self, io, names: list[str]) -> list[int | None]:
        """-1 for a present object (the plugin does not report sizes), None when absent."""
        infos = io.query([(0, 0, next(self._ids), n) for n in names])
        return [None if info is None else -1 for info in infos]

    def commit_lock(self):
        """No cross-client lock on S3: concurrent writers of one page may leave a torn page,
        which readers detect by its page digest (a miss, removed)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass

    def stored_size(self, name: str) -> int | None:
        """Size from the S3 API (boto3), used only to explain a failed read; None if unknown."""
        client = self._s3()
        try:
            return None if client is None else int(client.head_object(Bucket=self.params["bucket"], Key=name)["ContentLength"])
        except Exception:  # noqa: BLE001 - an unexplained failure stays a counted failure
            return None

    def open_read(self, name: str, direct: bool) -> tuple[Target, int]:
        return Target(name, next(self._ids), name), -1

    def open_write(self, name: str, direct: bool) -> Target:
        return Target(name, next(self._ids), name)

    def finish(self, target: Target, commit: bool) -> None:
        pass

    def remove(self, name: str) -> None:
        """Delete through the S3 API (boto3) when available; NIXL has no delete."""
        client = self._s3()
        if client is None:
            logger.warning("cannot delete object %s: boto3 is not installed", name)
            return
        try:
            client.delete_object(Bucket=self.params["bucket"], Key=name)
        except Exception:  # noqa: BLE001 - removal is best effort; the read already missed
            logger.warning("deleting object %s failed", name, exc_info=True)

    def _s3(self):
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                return None
            p = self.params
            endpoint = p.get("endpoint_override")
            if endpoint and "://" not in endpoint:
                endpoint = f"{p.get('scheme', 'https')}://{endpoint}"
            self._client = boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=p.get("region"),
                aws_access_key_id=p.get("access_key"),
                aws_secret_access_key=p.get("secret_key"),
                # bounded like the NIXL calls: a dead endpoint costs one timeout, not SDK retries
                config=Config(connect_timeout=self.timeout_s, read_timeout=self.timeout_s,
                              retries={"max_attempts": 1}),
            )
        return self._client

    def clear(self) -> None:
        logger.warning("clear() is not supported for the NIXL OBJ plugin; delete the bucket's objects instead")


def probe_direct_io(root: str) -> bool:
    """Whether files under ``root`` can be written with O_DIRECT (tmpfs, for one, refuses)."""
    import mmap

    path = os.path.join(root, f".direct_probe.{os.getpid()}.{threading.get_ident()}")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            return os.write(fd, buf) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        unlink_quiet(path)
