"""mem_cache/memory_pool_host.py: the DeepSeek-V4 host pools on upstream's constructors, and
``is_stride_page_aligned(page_size_bytes=...)`` on every pool named by upstream's seed 001."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import DeepSeekV4StatePool, LogicalAnchorPool, PoolKind
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool

register_cpu_ci(est_time=3, suite="per-commit-cpu")

P = 64


def test_state_pool_is_sized_by_host_pages():
    dev = DeepSeekV4StatePool(4 * P, P, 32, 2, torch.float32)
    host = DeepSeekV4StateHostPool("c4_state", [dev], 6, P, "page_first_direct", "cpu", False, io_backend="direct")
    assert (host.pool_name, host.size, host.page_num, host.page_size) == ("c4_state", 6 * P, 6, P)
    assert host.state_pools == [dev] and host.kv_buffer.shape == (6, 2, P, 32)
    with pytest.raises(ValueError, match="state_pools must be \\[the DeepSeekV4StatePool\\]"):
        DeepSeekV4StateHostPool("c4_state", [dev, dev], 6, P)
    with pytest.raises(ValueError, match="page_size 32 differs from the device pool's 64"):
        DeepSeekV4StateHostPool("c4_state", [dev], 6, 32)


def test_logical_pool_copies_nothing():
    anchor_dev = LogicalAnchorPool(4 * P, P, 2)
    host = LogicalHostPool(8 * P, P, "page_first_direct")
    slots = host.alloc(P)
    host.backup_from_device_all_layer(anchor_dev, slots, torch.arange(P, 2 * P))
    assert host.get_data_page(0).numel() == 0 and host.get_page_buffer_meta(slots) == ([], [])
    with pytest.raises(ValueError, match="does not match this dsv4_anchor host pool / page 64"):
        host.backup_from_device_all_layer(LogicalAnchorPool(4 * 16, 16, 2), slots[:16], torch.arange(16, 32))


def test_page_size_bytes_keyword_on_every_seed_pool():
    """16 KiB state pages are 4 KiB-aligned; the DSA indexer's 512-byte scale pages are not."""
    state_dev = DeepSeekV4StatePool(8 * P, P, 32, 2, torch.float32)
    state = DeepSeekV4StateHostPool("state", [state_dev], 8, P, "page_first_direct", io_backend="direct")
    anchor = LogicalHostPool(8 * P, P, "page_first_direct")
    idx_dev = make_device_pool(PoolKind.DSA_INDEXER, torch.float32, P)
    indexer = DSAIndexerPoolHost(idx_dev, anchor, "page_first_direct", io_backend="direct")
    mamba = MambaPoolHost(make_device_pool(PoolKind.MAMBA, torch.float32, 1), 2.0, io_backend="direct")
    assert state.is_stride_page_aligned(page_size_bytes=4096)
    assert not indexer.is_stride_page_aligned(page_size_bytes=4096)
    assert indexer.is_stride_page_aligned(page_size_bytes=256)
    # Mamba (fp32): per-request strides of 128 B (temporal) and 96 B (each conv) over 2 layers
    assert mamba.is_stride_page_aligned(page_size_bytes=32) and not mamba.is_stride_page_aligned(page_size_bytes=128)
    group = HostPoolGroup([PoolEntry(PoolName.KV, anchor, None, is_primary_index_anchor=True),
                           PoolEntry(PoolName.DSV4_STATE, state, state_dev, shares_anchor_slots=True),
                           PoolEntry(PoolName.INDEXER, indexer, idx_dev, shares_anchor_slots=True)])
    assert not group.is_stride_page_aligned(page_size_bytes=4096)
    assert group.is_stride_page_aligned(page_size_bytes=256)
