"""The file and NIXL backends' default directories are per user and private: ``<tempdir>/
hicache-<uid>`` (and ``hicache_storage-<uid>``), created 0700; a symlink or a non-directory
planted at that name is refused, never followed."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from sglang.srt.mem_cache.storage.file.page_files import PageFiles, parse_file_options
from sglang.srt.mem_cache.storage.nixl.nixl_config import parse_nixl_options
from sglang.srt.mem_cache.storage.stats import StorageStats
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", raising=False)
    return tmp_path


def test_file_backend_default_directory_is_private_to_the_user(tmpdir_root):
    files = PageFiles(parse_file_options({}), StorageStats())
    want = tmpdir_root / f"hicache-{os.geteuid()}"
    assert files.root == str(want)
    assert stat.S_IMODE(os.stat(want).st_mode) == 0o700


def test_a_symlink_planted_at_the_default_name_is_refused(tmpdir_root):
    target = tmpdir_root / "elsewhere"
    target.mkdir()
    (tmpdir_root / f"hicache-{os.geteuid()}").symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        PageFiles(parse_file_options({}), StorageStats())
    assert list(target.iterdir()) == []  # nothing was made through the link


def test_nixl_default_directory_is_private_to_the_user(tmpdir_root):
    opts = parse_nixl_options({})
    want = str(tmpdir_root / f"hicache_storage-{os.geteuid()}")
    assert want in [os.path.abspath(d) for d in opts.storage_dirs]
    assert stat.S_IMODE(os.stat(want).st_mode) == 0o700


def test_a_configured_directory_is_used_as_given(tmpdir_root):
    mine = tmpdir_root / "mine"
    files = PageFiles(parse_file_options({"storage_dir": str(mine)}), StorageStats())
    assert files.root == str(mine) and not (tmpdir_root / f"hicache-{os.geteuid()}").exists()
