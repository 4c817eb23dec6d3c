"""A read-only storage directory (a read-only bind mount, the EROFS of a remounted disk): both
file backends start on it, serve the pages already there bit for bit, and every set is a miss,
logged once. A directory that does not exist and cannot be created is refused at startup with an
error naming it (never a raw OSError)."""

import contextlib
import logging
import os
import subprocess

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, pages_of, slots, storage_config

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

BACKENDS = {"file": "file", "nixl_posix": "nixl"}


def _try(*cmd) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


@contextlib.contextmanager
def read_only(path: str):
    """Make ``path`` read-only for this process: a read-only bind mount (root), else modes."""
    undo = []
    if os.geteuid() == 0 and _try("mount", "--bind", path, path):
        undo.append(("umount", path))
        if not _try("mount", "-o", "remount,bind,ro", path):
            undo.append(("chmod", "-R", "u+w", path))
    elif os.geteuid() == 0 and _try("chattr", "-R", "+i", path):
        undo.append(("chattr", "-R", "-i", path))
    else:
        _try("chmod", "-R", "a-w", path)
        undo.append(("chmod", "-R", "u+w", path))
    try:
        probe = os.path.join(path, "probe")
        with pytest.raises(OSError):  # the test is only meaningful on a directory we cannot write
            open(probe, "w").close()
        yield
    finally:
        for cmd in reversed(undo):
            _try(*cmd)


def make(name, host, root, **extra):
    return StorageBackendFactory.create_backend(BACKENDS[name], storage_config(host, {"storage_dir": root, **extra}), host)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_read_only_directory_serves_reads_and_sets_miss(name, tmp_path, caplog):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=4)
    root, keys = str(tmp_path / "store"), page_keys(5)
    writer = make(name, host, root)
    assert writer.batch_set_v1(keys[:3], slots(host, 0, 3)) == [True] * 3
    writer.close()
    with read_only(root), caplog.at_level(logging.WARNING):
        store = make(name, host, root)
        try:
            assert store.batch_exists(keys) == 3
            assert store.batch_get_v1(keys[:3], slots(host, 8, 3)) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(pages_of(host, 8, 3), pages_of(host, 0, 3)))
            for _ in range(3):
                assert store.batch_set_v1(keys[3:], slots(host, 3, 2)) == [False, False]
            assert store.batch_exists(keys) == 3
        finally:
            store.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and root in r.getMessage()]
    assert len(warnings) == 1 and "not writable" in warnings[0].getMessage()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_empty_read_only_directory_starts_and_misses(name, tmp_path):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    root = tmp_path / "empty"
    root.mkdir()
    with read_only(str(root)):
        store = make(name, host, str(root))
        try:
            assert store.batch_exists(page_keys(2)) == 0
            assert store.batch_get_v1(page_keys(2), slots(host, 0, 2)) == [False, False]
            assert store.batch_set_v1(page_keys(2), slots(host, 0, 2)) == [False, False]
        finally:
            store.close()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_directory_that_cannot_be_created_is_refused_by_name(name, tmp_path):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    parent = tmp_path / "parent"
    parent.mkdir()
    missing = str(parent / "store")
    with read_only(str(parent)):
        with pytest.raises(ValueError, match=f"storage_dir.*{missing}.*cannot be created"):
            make(name, host, missing)
