"""HiCache auto-sizing (upstream's --hicache-host-memory-fraction): the host memory budget read from
a fake /proc (meminfo, self/cgroup, self/mountinfo naming fake cgroup v1/v2 mounts), the default
ratio lowered (never raised) to fit it, agreed with MIN over TP ranks, and the cache factory
building every host pool of a KV + Mamba stack with the lowered ratio."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers import cache_factory
from sglang.srt.mem_cache import hicache_auto_size as auto
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _default_reserve(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_HOST_MEM_RESERVE_GB", raising=False)


def fake_proc(root: Path, mem_available: int, cgroup: str | None = None, mountinfo: str = "") -> Path:
    """A proc root with ``meminfo`` (MemAvailable in bytes, a multiple of 1 KiB) and, when
    ``cgroup`` is given, ``self/cgroup`` and ``self/mountinfo``."""
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       999999999 kB\nMemFree:  1 kB\n"
                                  f"MemAvailable:   {mem_available // 1024} kB\nBuffers: 0 kB\n")
    if cgroup is not None:
        (proc / "self/cgroup").write_text(cgroup)
        (proc / "self/mountinfo").write_text(mountinfo)
    return proc


def cgroup_level(directory: Path, usage_name: str, usage: int, stat: dict[str, int], **limits: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / usage_name).write_text(f"{usage}\n")
    (directory / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))
    for name, value in limits.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{value}\n")


def v2_tree(tmp_path: Path, parent_max: int) -> Path:
    """/a/b in a cgroup2 mount: /a has memory.max ``parent_max`` (2 GiB in use beyond 1 GiB of
    file cache), /a/b memory.high 5 GiB (1 GiB in use); the mount root has no limit files."""
    mount = tmp_path / "cg2"
    mount.mkdir(parents=True)
    cgroup_level(mount / "a", "memory.current", 3 * GiB, {"anon": 2 * GiB, "active_file": GiB // 2,
                                                           "inactive_file": GiB // 2},
                 memory_max=str(parent_max), memory_high="max")
    cgroup_level(mount / "a/b", "memory.current", GiB, {"anon": GiB, "active_file": 0, "inactive_file": 0},
                 memory_max="max", memory_high=str(5 * GiB))
    return fake_proc(tmp_path, 64 * GiB, "12:cpu:/x\n0::/a/b\n",
                     f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
                     f"31 23 0:27 / {tmp_path}/other rw - tmpfs tmpfs rw\n")


def test_meminfo_mem_available_in_bytes():
    assert auto.mem_available_bytes("MemTotal: 10 kB\nMemAvailable:    2048 kB\n") == 2 * 1024 * 1024
    with pytest.raises(ValueError, match="no MemAvailable"):
        auto.mem_available_bytes("MemTotal: 10 kB\n")


def test_cgroup_v2_headroom_is_the_tightest_level(tmp_path):
    # /a/b: 5 GiB high - 1 GiB used = 4 GiB; /a: 8 GiB max - (3 GiB - 1 GiB file cache) = 6 GiB
    assert auto.cgroup_headroom_bytes(v2_tree(tmp_path / "loose", 8 * GiB)) == 4 * GiB
    # a parent's limit bounds its child: /a 4 GiB max - 2 GiB = 2 GiB
    assert auto.cgroup_headroom_bytes(v2_tree(tmp_path / "tight", 4 * GiB)) == 2 * GiB


def test_cgroup_v1_memory_hierarchy_with_a_mount_root(tmp_path):
    mount = tmp_path / "memory"
    cgroup_level(mount / "x", "memory.usage_in_bytes", 3 * GiB // 2,
                 {"inactive_file": GiB, "total_inactive_file": GiB // 2, "total_active_file": 0},
                 memory_limit_in_bytes=str(2 * GiB))
    cgroup_level(mount, "memory.usage_in_bytes", 9 * GiB, {"total_inactive_file": 0, "total_active_file": 0},
                 memory_limit_in_bytes="9223372036854771712")  # v1's "no limit"
    proc = fake_proc(tmp_path, 64 * GiB, "5:devices:/docker/x\n4:memory:/docker/x\n0::/\n",
                     f"35 31 0:32 /docker {mount} rw,relatime - cgroup cgroup rw,memory\n"
                     f"36 31 0:33 /docker {tmp_path}/devices rw,relatime - cgroup cgroup rw,devices\n")
    # 2 GiB - (1.5 GiB - 0.5 GiB of file cache, the total_ counters) = 1 GiB; the v2 line has no mount
    assert auto.cgroup_headroom_bytes(proc) == GiB


def test_cgroup_namespace_membership_is_relative_to_the_mount(tmp_path):
    mount = tmp_path / "cg2"
    cgroup_level(mount, "memory.current", GiB, {"active_file": 0, "inactive_file": 0}, memory_max=str(3 * GiB))
    proc = fake_proc(tmp_path, 64 * GiB, "0::/\n", f"30 23 0:26 /kubepods/pod1 {mount} rw - cgroup2 cgroup2 rw\n")
    assert auto.cgroup_headroom_bytes(proc) == 2 * GiB


def test_cgroup_missing_or_unmounted(tmp_path):
    assert auto.cgroup_headroom_bytes(fake_proc(tmp_path / "bsd", GiB)) is None  # no self/cgroup
    unmounted = fake_proc(tmp_path / "lost", GiB, "0::/a\n", f"31 23 0:27 / {tmp_path} rw - tmpfs tmpfs rw\n")
    with pytest.raises(ValueError, match="cannot find this process's memory cgroup"):
        auto.cgroup_headroom_bytes(unmounted)


def test_budget_is_fraction_of_bounded_available_less_reserve_per_rank(tmp_path, monkeypatch):
    # MemAvailable 64 GiB, cgroup 4 GiB: reserve min(10 GiB, a fifth) = 0.8 GiB; 3.2 GiB x 0.5 / 2 ranks
    proc = v2_tree(tmp_path / "cg", 8 * GiB)
    assert auto.host_memory_budget_bytes(0.5, 2, proc) == int((4 * GiB - 4 * GiB // 5) // 2 * 0.5)
    # no cgroup, 200 GiB available: upstream's 10 GiB reserve
    assert auto.host_memory_budget_bytes(0.8, 1, fake_proc(tmp_path / "big", 200 * GiB)) == int(190 * GiB * 0.8)
    monkeypatch.setenv("SGLANG_HICACHE_HOST_MEM_RESERVE_GB", "0")
    assert auto.host_memory_budget_bytes(1.0, 4, fake_proc(tmp_path / "env", 8 * GiB)) == 2 * GiB


def test_ratio_is_lowered_never_raised_and_agreed_with_min(tmp_path):
    proc = fake_proc(tmp_path, 200 * GiB)
    budget = auto.host_memory_budget_bytes(1.0, 1, proc)  # 190 GiB
    assert auto.auto_size_hicache(2.0, 1.0, GiB, ranks_per_host=1, proc_root=proc) == 2.0
    fitted = auto.auto_size_hicache(2.0, 1.0, 100 * GiB, ranks_per_host=1, proc_root=proc)
    slack = 1 - auto.ALLOCATION_SLACK_FRACTION
    assert fitted == int(budget * slack / (100 * GiB) * auto.RATIO_SCALE) / auto.RATIO_SCALE
    assert 1.8 < fitted < 1.81 and fitted * 100 * GiB <= budget * 0.95
    calls = []

    def peer_min(values):  # another rank fitted 0.5
        calls.append(list(values))
        return [min(values[0], 500_000)]

    assert auto.auto_size_hicache(2.0, 1.0, GiB, ranks_per_host=1, agree_min=peer_min, proc_root=proc) == 0.5
    assert calls == [[2_000_000]]


def test_failures_still_join_the_agreement(tmp_path):
    calls = []

    def agree(values):
        calls.append(list(values))
        return list(values)

    broken = tmp_path / "broken"
    (broken / "self").mkdir(parents=True)  # no meminfo
    with pytest.raises(ValueError, match="cannot read the host memory.*--hicache-ratio or --hicache-size"):
        auto.auto_size_hicache(2.0, 0.8, GiB, ranks_per_host=1, agree_min=agree, proc_root=broken)
    assert calls == [[-1]]
    with pytest.raises(ValueError, match="failed on another TP rank"):
        auto.auto_size_hicache(2.0, 0.8, GiB, ranks_per_host=1, agree_min=lambda v: [-1],
                               proc_root=fake_proc(tmp_path / "ok", 200 * GiB))
    with pytest.raises(ValueError, match="no host memory is left for HiCache"):
        auto.auto_size_hicache(2.0, 0.8, GiB, ranks_per_host=1, proc_root=fake_proc(tmp_path / "empty", 0))


def test_decision_logged_once_at_info_on_rank_0(tmp_path, caplog):
    proc = fake_proc(tmp_path, 200 * GiB)
    with caplog.at_level(logging.INFO, logger=auto.__name__):
        auto.auto_size_hicache(2.0, 0.8, 100 * GiB, ranks_per_host=2, tp_rank=1, proc_root=proc)
        assert not caplog.records
        auto.auto_size_hicache(2.0, 0.8, 100 * GiB, ranks_per_host=2, tp_rank=0, proc_root=proc)
    [record] = caplog.records
    assert record.levelno == logging.INFO and "ratio 2.000 -> 0.722" in record.getMessage()


def kv_mamba_runner(monkeypatch):
    kv = MHATokenToKVPool(256, 4, torch.float32, 1, 32, 2)
    mamba = MambaPool(16, [(2, 3)], (2, 4), 2, conv_dtype=torch.float32)
    alloc = PagedTokenToKVPoolAllocator(kv.size, 4, kvcache=kv)
    monkeypatch.setattr(cache_factory, "cache_init_params",
                        lambda args, runner: CacheInitParams(page_size=4, token_to_kv_pool_allocator=alloc))
    return SimpleNamespace(token_to_kv_pool=kv, side_pools={}, state_pool=mamba, all_pools=[kv, mamba])


def host_sizes(args, runner) -> tuple[int, int]:
    tree = cache_factory.build_tree_cache(args, runner)
    try:
        group = tree.cache_controller.host_pool_group
        return group.get_entry(PoolName.KV).host_pool.size, group.get_entry(PoolName.MAMBA).host_pool.size
    finally:
        tree.cache_controller.close()


def test_factory_sizes_every_host_pool_from_the_lowered_ratio(tmp_path, monkeypatch):
    runner = kv_mamba_runner(monkeypatch)
    device_bytes = sum(p.mem_usage_bytes() for p in runner.all_pools)
    monkeypatch.setenv("SGLANG_HICACHE_HOST_MEM_RESERVE_GB", "0")
    # a budget that fits 1.5x both device pools (not the KV pool alone: 2x of it would fit)
    budget = int(1.5 * device_bytes / 0.95) // 1024 * 1024
    monkeypatch.setattr(auto, "PROC_ROOT", fake_proc(tmp_path, budget))
    ratio = int(budget * (1 - auto.ALLOCATION_SLACK_FRACTION) / device_bytes * auto.RATIO_SCALE) / auto.RATIO_SCALE
    assert 1.49 < ratio < 1.5  # the budget is whole KiB
    args = ServerArgs(model_path="/m", enable_hierarchical_cache=True, hicache_host_memory_fraction=1.0)
    assert host_sizes(args, runner) == (int(256 * ratio) // 4 * 4, int(16 * ratio)) == (380, 23)
    # an explicit ratio is used as given: the small budget is not read
    monkeypatch.setattr(auto, "PROC_ROOT", tmp_path / "absent")
    assert host_sizes(ServerArgs(model_path="/m", enable_hierarchical_cache=True, hicache_ratio=2.0),
                      runner) == (512, 32)
