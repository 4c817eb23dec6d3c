"""The storage side of a NIXL transfer: files for the POSIX plugin, objects for the OBJ plugin.

Each side turns an object name into a NIXL device id + metadata for one transfer and makes
writes atomic: POSIX writes a private temporary file and renames it over the final name; an
S3 PUT is atomic by itself. Files live at ``<root>/<name[:2]>/<name>``, the root chosen from
``storage_dirs`` by the name's page group.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass

from sglang.srt.mem_cache.storage.nixl.nixl_config import NixlOptions
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


class PosixSide:
    """Files under one or more root directories; the device id is an open file descriptor.

    A name starts with its page group (``PoolCodec``, grouped), so every object of a page hash
    lands in one bucket of one root: ``<roots[route(name)]>/<name[:2]>/<name>``. The route is a
    stable hash of the group, so a reopened store with the same ``storage_dirs`` finds every page.
    A root that cannot be written (read-only mount or mode) makes the store read-only: reads are
    served, writes miss (``read_only``)."""

    def __init__(self, options: NixlOptions):
        self.roots = options.storage_dirs
        self.root = self.roots[0]
        key = "storage_dirs" if len(self.roots) > 1 else "storage_dir"
        writable = [prepare_root(r, "nixl backend", key) for r in self.roots]
        self.read_only = not all(writable)
        if self.read_only:
            logger.warning("HiCacheNixl: %s not writable: serving reads only, every set is a miss",
                           ", ".join(r for r, w in zip(self.roots, writable) if not w))
        self.direct_supported = not self.read_only and all(probe_direct_io(r) for r in self.roots)
        self.tmp_names = TempNames()
        self._commit_lock = None if self.read_only else CommitLock(self.root)

    def commit_lock(self):
        """Held while a batch of written objects is renamed into place (see CommitLock)."""
        return contextlib.nullcontext() if self._commit_lock is None else self._commit_lock.held()

    def close(self) -> None:
        if self._commit_lock is not None:
            self._commit_lock.close()

    def root_of(self, name: str) -> str:
        """The root of ``name``'s page group (names are hex: digits 2-9 of the group pick it)."""
        return self.roots[int(name[2:10], 16) % len(self.roots)] if len(self.roots) > 1 else self.root

    def path(self, name: str) -> str:
        return f"{self.root_of(name)}/{name[:2]}/{name}"

    def paths(self, names: list[str]) -> list[str]:
        if len(self.roots) > 1:
            return [self.path(n) for n in names]
        root = self.root
        return [f"{root}/{n[:2]}/{n}" for n in names]

    def sizes(self, io, names: list[str]) -> list[int | None]:
        """Stored size of each object (None when absent)."""
        infos = io.query([(0, 0, 0, self.path(n)) for n in names])
        return [None if info is None else int(info.get("size", -1)) for info in infos]

    def stored_size(self, name: str) -> int | None:
        try:
            return os.stat(self.path(name)).st_size
        except FileNotFoundError:
            return None

    def open_read(self, name: str, direct: bool) -> tuple[Target | None, int | None]:
        """(target, stored size); (None, None) when absent."""
        try:
            fd = open_read(self.path(name), os.O_DIRECT if direct else 0)
        except FileNotFoundError:
            return None, None
        return Target(name, fd, ""), os.fstat(fd).st_size

    def open_write(self, name: str, direct: bool) -> Target:
        path = self.path(name)
        tmp = f"{path}{self.tmp_names.tag()}0"
        return Target(name, create_exclusive(tmp, os.O_DIRECT if direct else 0), "", tmp)

    def finish(self, target: Target, commit: bool) -> None:
        """Close; a write is renamed into place when ``commit``, else its temp file removed."""
        os.close(target.dev_id)
        if target.tmp_path:
            if commit:
                os.replace(target.tmp_path, self.path(target.name))
            else:
                unlink_quiet(target.tmp_path)

    def remove(self, name: str) -> None:
        unlink_quiet(self.path(name))

    def buckets(self):
        """Every bucket directory of every root (DirEntry)."""
        for root in self.roots:
            for bucket in os.scandir(root):
                if bucket.is_dir() and len(bucket.name) == 2:
                    yield bucket

    def clear(self) -> None:
        for bucket in self.buckets():
            for entry in os.scandir(bucket.path):
                unlink_quiet(entry.path)


class ObjSide:
    """Objects in one bucket; the device id is a process-unique number bound to the key."""

    direct_supported = False

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
