"""File-system helpers shared by the file backend and the NIXL POSIX side.

Both keep objects at ``<root>/<first 2 hex digits of the name>/<name>[suffix]``. The 256
bucket directories are created once, at startup, so that a write costs one file creation and
one rename and never a ``mkdir``; a bucket removed behind our back is recreated on demand.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import threading

# O_NOATIME: reading a page does not dirty its inode (with relatime the first read after a write
# would). Only the file's owner may use it; other files are opened without it.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def make_buckets(root: str) -> None:
    for i in range(256):
        os.makedirs(os.path.join(root, f"{i:02x}"), exist_ok=True)


def prepare_root(root: str, where: str, key: str) -> bool:
    """Create ``root`` (and its buckets when it is writable); return whether it is writable.
    ValueError naming the directory and ``key`` when it cannot be created, is not a directory or
    cannot be read. A read-only root is not an error: the backend serves reads from it."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{where}: extra config key {key!r}: directory {root} does not exist and cannot be "
                         f"created ({exc.strerror})") from None
    if not os.path.isdir(root) or not os.access(root, os.R_OK | os.X_OK):
        raise ValueError(f"{where}: extra config key {key!r}: {root} is not a readable directory")
    if not is_writable(root):
        return False
    try:
        make_buckets(root)
    except OSError:
        return False
    return True


def is_writable(root: str) -> bool:
    """Whether a file can be created in ``root`` (a read-only mount or mode says no)."""
    path = os.path.join(root, f".write_probe.{os.getpid()}.{threading.get_ident()}")
    try:
        os.close(os.open(path, _CREATE_FLAGS, 0o644))
    except OSError:
        return False
    unlink_quiet(path)
    return True


def open_read(path: str, extra_flags: int = 0) -> int:
    """An fd for reading ``path``; FileNotFoundError when it is absent."""
    try:
        return os.open(path, READ_FLAGS | extra_flags)
    except PermissionError:
        return os.open(path, os.O_RDONLY | extra_flags)


def create_exclusive(path: str, extra_flags: int = 0) -> int:
    """A new file (O_EXCL) for writing; recreates its bucket directory if it was removed."""
    try:
        return os.open(path, _CREATE_FLAGS | extra_flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, _CREATE_FLAGS | extra_flags, 0o644)


def unlink_quiet(path: str) -> bool:
    """Best-effort removal; whether a file was removed (absent or not removable: False)."""
    try:
        os.unlink(path)
        return True
    except OSError:  # absent, or a read-only directory: the caller's miss stands either way
        return False


class TempNames:
    """Tags of private temporary files, ``<final path><tag><n>``: unique per process, thread and
    call, so concurrent writers never share one; stale ones are found by ``.tmp.``."""

    def __init__(self):
        self._ids = itertools.count()
        self._pid = os.getpid()

    def tag(self) -> str:
        return f".tmp.{self._pid}.{threading.get_ident()}.{next(self._ids)}."


class CommitLock:
    """An exclusive ``flock`` on one file under ``root``, across processes: writers hold it while
    they rename a batch of objects into place, so the objects of one page written by two
    writers are never interleaved. One lock per batch, not per page. ``flock`` on one open file
    does not exclude the threads sharing it, so a thread lock is taken first."""

    def __init__(self, root: str):
        os.makedirs(os.path.join(root, ".locks"), exist_ok=True)
        self._fd = os.open(os.path.join(root, ".locks", "commit"), os.O_RDWR | os.O_CREAT, 0o644)
        self._threads = threading.Lock()

    @contextlib.contextmanager
    def held(self):
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
