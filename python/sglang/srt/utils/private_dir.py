"""Per-user private directories for defaults that used to be fixed names under /tmp.

``user_private_dir("hicache")`` is ``<tempdir>/hicache-<uid>`` (``tempfile.gettempdir()``, so
``TMPDIR`` moves it), made safe by ``ensure_private_dir``. A fixed shared name lets another
user create the directory first (or a symlink to one of yours) and then read, plant or delete
the pages a storage backend keeps there.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile

logger = logging.getLogger(__name__)

PRIVATE_MODE = 0o700


def ensure_private_dir(path: str) -> str:
    """Create ``path`` with mode 0700 when absent (its parent must exist); return it.

    An existing ``path`` must be a real directory (a symlink is refused, not followed) owned by
    this user; group or other permission bits on it are removed (warning). ``PermissionError``
    naming the path when it is a symlink, not a directory or another user's."""
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        pass
    if os.path.islink(path):
        raise PermissionError(f"{path} is a symlink; a private directory must be a real directory "
                              "(remove it, or give a directory explicitly)")
    try:  # checked through the descriptor: what was checked is what gets changed
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError(f"{path} is not a directory this user can open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                                  "refusing to use another user's directory")
        if stat.S_IMODE(st.st_mode) & 0o077:
            logger.warning("%s had mode %o; setting %o", path, stat.S_IMODE(st.st_mode), PRIVATE_MODE)
            os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)
    return path


def user_private_dir(name: str, base: str | None = None) -> str:
    """``<base or the temp dir>/<name>-<uid>``, created 0700 and checked by ``ensure_private_dir``."""
    return ensure_private_dir(os.path.join(base or tempfile.gettempdir(), f"{name}-{os.geteuid()}"))
