"""NixlFileManager and nixl_routing: where a NIXL FILE object lives (by its page group, stable
across processes, spread over disks and buckets), upstream's file-manager calls, and a
filesystem without O_DIRECT: HiCacheNixl still starts, buffered, after one warning."""

import fcntl
import hashlib
import logging
import os

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, slots

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.nixl import nixl_utils
from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
from sglang.srt.mem_cache.storage.nixl.nixl_routing import BUCKET_HEX_CHARS, route_disk, route_key
from sglang.srt.mem_cache.storage.nixl.nixl_utils import NixlFileManager
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")


def test_route_is_a_stable_hash_of_the_page_group():
    # derived here from the bytes alone: the same in every process (not Python's salted hash())
    h = int.from_bytes(hashlib.blake2b(b"grp", digest_size=8).digest(), "little")
    assert route_key("grp", 5) == ((h >> 32) % 5, f"{h % 256:02x}") and BUCKET_HEX_CHARS == 2
    assert route_key("grp.stem_k", 5) == route_key("grp.stem_v", 5) == route_key("grp", 5)  # one group, one dir
    assert route_disk("grp.x", 5) == route_key("grp", 5)[0]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_disks must be >= 1"):
            route_key("grp", bad)


def test_groups_spread_over_disks_and_buckets():
    routes = [route_key(f"{i:032x}", 3) for i in range(3000)]
    disks = [sum(d == k for d, _ in routes) for k in range(3)]
    assert all(800 < n < 1200 for n in disks), disks
    assert len({b for _, b in routes}) == 256


def test_file_manager_places_opens_and_clears(tmp_path):
    dirs = [str(tmp_path / f"disk{i}") for i in range(3)]
    fm = NixlFileManager(dirs, use_direct_io=False)
    assert fm.iter_all_base_dirs() == dirs and all(os.path.isdir(d) for d in dirs)
    disk, bucket = route_key("g1", 3)
    assert fm.get_file_path("g1.obj_k") == os.path.join(dirs[disk], bucket, "g1.obj_k")
    assert fm.paths(["g1.obj_k", "g1.obj_v"]) == [os.path.join(dirs[disk], bucket, n) for n in ("g1.obj_k", "g1.obj_v")]
    os.rmdir(os.path.join(dirs[disk], bucket))  # a bucket removed behind our back is recreated
    assert fm.open_file(fm.get_file_path("g1.obj_k")) is None  # absent, not created
    fd = fm.open_file(fm.get_file_path("g1.obj_k"), create=True)
    assert fd is not None and not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    assert fm.close_file(fd) and not fm.close_file(fd)
    placed = [fm.get_file_path(f"{i:032x}.o") for i in range(40)]
    for path in placed:
        fm.close_file(fm.open_file(path, create=True))
    assert {p.split(os.sep)[-3] for p in placed} == {"disk0", "disk1", "disk2"}
    fm.clear()
    assert not any(os.path.exists(p) for p in placed + [fm.get_file_path("g1.obj_k")])
    fm.close()


def test_open_file_asks_for_o_direct_when_the_filesystem_takes_it(tmp_path):
    fm = NixlFileManager(str(tmp_path), use_direct_io=True)
    fd = fm.open_file(fm.get_file_path("g.o"), create=True)
    try:  # the manager keeps use_direct_io only where its probe succeeded; open_file follows it
        assert bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT) == fm.use_direct_io
    finally:
        os.close(fd)
    fm.close()


def test_a_filesystem_without_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(nixl_utils, "probe_direct_io", lambda root: False)
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=3)
    with caplog.at_level(logging.WARNING, logger=nixl_utils.__name__):
        store = HiCacheNixl(HiCacheStorageConfig(model_name="m"), file_path=str(tmp_path))
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and "buffered" in warnings[0].getMessage()
    assert store.needs_page_alignment and not store.file_manager.use_direct_io
    store.register_mem_pool_host(host)
    assert not store._hybrid_pool_ctx[next(iter(store.codecs))].direct
    keys = page_keys(2)
    assert store.batch_set_v1(keys, slots(host, 0, 2)) == [True, True]
    assert store.batch_get_v1(keys, slots(host, 4, 2)) == [True, True]
    assert all(torch.equal(host.get_data_page((4 + i) * 4), host.get_data_page(i * 4)) for i in range(2))
    store.close()


def test_hicache_nixl_directories_and_agent(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", raising=False)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    off = {"use_direct_io": False}
    store = HiCacheNixl(HiCacheStorageConfig(model_name="m", extra_config=off), file_path=f"{a},{b}")
    assert store.file_manager.iter_all_base_dirs() == [a, b] and not store.needs_page_alignment
    host = host_pool(PoolKind.MLA, "page_first_direct")
    fill_random(host, seed=4)
    store.register_mem_pool_host(host)
    calls = []
    real = store.agent.initialize_xfer
    store.agent.initialize_xfer = lambda *args: calls.append(args[0]) or real(*args)
    assert store.batch_set_v1(page_keys(1), slots(host, 0, 1)) == [True]
    assert calls == ["WRITE"]  # ``agent`` is the agent that moves the data
    store.close()
    c = str(tmp_path / "c")
    given = HiCacheNixl(HiCacheStorageConfig(model_name="m", extra_config={**off, "storage_dir": c}), file_path=a)
    assert given.file_manager.iter_all_base_dirs() == [c]  # the extra config wins over file_path
    given.close()
