"""File-system helpers shared by the file backend and the NIXL POSIX side.

Both keep objects at ``<root>/<first 2 hex digits of the name>/<name>[suffix]``. The 256
bucket directories are created once, at startup, so that a write costs one file creation and
one rename and never a ``mkdir``; a bucket removed behind our back is recreated on demand.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

# O_NOATIME: reading a page does not dirty its inode (with relatime the first read after a write
# would). Only the file's owner may use it; other files are opened without it.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def make_buckets(root: str) -> None:
    for i in range(256):
        os.makedirs(os.path.join(root, f"{i:02x}"), exist_ok=True)


def open_read(path: str, extra_flags: int = 0) -> int:
    """An fd for reading ``path``; FileNotFoundError when it is absent."""
    try:
        return os.open(path, _READ_FLAGS | extra_flags)
    except PermissionError:
        return os.open(path, os.O_RDONLY | extra_flags)


def create_exclusive(path: str, extra_flags: int = 0) -> int:
    """A new file (O_EXCL) for writing; recreates its bucket directory if it was removed."""
    try:
        return os.open(path, _CREATE_FLAGS | extra_flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, _CREATE_FLAGS | extra_flags, 0o644)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class CommitLock:
    """An exclusive ``flock`` on one file under ``root``, across processes: writers hold it while
    they rename a batch of objects into place, so the objects of one page written by two
    writers are never interleaved. One lock per batch, not per page."""

    def __init__(self, root: str):
        os.makedirs(os.path.join(root, ".locks"), exist_ok=True)
        self._fd = os.open(os.path.join(root, ".locks", "commit"), os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def held(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
