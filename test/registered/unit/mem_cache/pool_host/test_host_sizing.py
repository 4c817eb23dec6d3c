"""Host pool sizing (ratio, GB, explicit), alignment of buffers, slot allocation."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.base import pins_by_default
from sglang.srt.mem_cache.pool_host.memory import available_host_bytes
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool, make_host_pool

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def test_sized_by_ratio_rounded_to_pages():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4, num_pages=8)  # 32 slots
    host = make_host_pool(dev, "layer_first", "direct", ratio=1.4)  # 44.8 -> 44 slots
    assert host.size == 44 and host.page_num == 11
    assert host.available_size() == 44
    assert host.get_size_per_token() == dev.get_size_per_token() == 2 * 2 * 2 * 8 * 2


def test_sized_by_gb():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4, num_pages=8)
    host = type(make_host_pool(dev, "layer_first", "direct"))(dev, 2.0, 1e-6, layout="layer_first", io_backend="direct")
    assert host.size == (1000 // 128) // 4 * 4  # 1000 bytes / 128 B per token, whole pages


def test_buffers_are_page_aligned_and_pinned_only_with_cuda():
    dev = make_device_pool(PoolKind.MLA, torch.bfloat16, page_size=4)
    host = make_host_pool(dev, "page_first_direct", "direct")
    for buf in host.get_host_buffers():
        assert buf.data_ptr() % 4096 == 0
    assert host.pin_memory == torch.cuda.is_available()


def test_too_large_is_refused():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4)
    too_many_gb = 4 * available_host_bytes() / 1e9
    with pytest.raises(ValueError, match="GiB of host memory but only .* lower --hicache-ratio or --hicache-size"):
        type(make_host_pool(dev, "layer_first", "direct"))(dev, 2.0, too_many_gb, layout="layer_first", io_backend="direct")


def test_smaller_than_a_page_is_refused():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="less than one page of 4"):
        make_host_pool(dev, "layer_first", "direct", ratio=0.1)
    with pytest.raises(ValueError, match="host_to_device_ratio must be > 0"):
        make_host_pool(dev, "layer_first", "direct", ratio=0)


def test_logical_pool_is_sized_in_slots_as_upstream():
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    pool = LogicalHostPool(64, 16, "page_first_direct")  # upstream's (size, page_size, layout)
    assert (pool.size, pool.page_num, pool.layer_num, pool.kv_buffer) == (64, 4, 0, None)
    assert pool.get_host_buffers() == [] and pool.get_size_per_token() == 0
    assert pool.alloc(32).tolist() == list(range(32))
    with pytest.raises(ValueError, match="positive multiple of page_size"):
        LogicalHostPool(40, 16)


def test_alloc_free_pages():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4, num_pages=8)
    host = make_host_pool(dev, "layer_first", "direct", ratio=1.0)  # 8 pages
    a = host.alloc(8)
    b = host.alloc(24)
    assert a.tolist() == list(range(0, 8)) and b.tolist() == list(range(8, 32))
    assert host.alloc(4) is None  # full: a documented refusal, nothing taken
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        host.alloc(3)
    host.free(a)
    with pytest.raises(ValueError, match="double free: page 0"):
        host.free(a[:4])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        host.free(b[:2])
    assert host.available_size() == 8
    assert host.alloc(8).tolist() == list(range(0, 8))


@pytest.mark.parametrize("kind", [PoolKind.MHA, PoolKind.MLA, PoolKind.MAMBA])
def test_a_cpu_pool_on_a_cuda_host_pins_nothing(kind, monkeypatch):
    """--device cpu on a machine with a GPU: host pools mirror a CPU device pool, so they pin no
    memory (pinning would make a CUDA context on GPU 0 for nothing). CUDA pools pinning by
    default is checked in test_pinned_host_cuda.py."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    host = make_host_pool(make_device_pool(kind), "layer_first", "direct")
    assert host.pin_memory is False
    assert pins_by_default("cpu") is False and pins_by_default("cuda:0") is True
