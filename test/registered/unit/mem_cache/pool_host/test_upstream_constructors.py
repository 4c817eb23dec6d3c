"""Host pools take upstream's constructor arguments, positionally and by keyword."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.layout import HostLayout
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def test_mha_keywords_and_kv_buffer_pair():
    dev = make_device_pool(PoolKind.MHA, torch.float16, page_size=4, num_pages=8)  # 32 slots, 128 B a token
    host = MHATokenToKVPoolHost(device_pool=dev, host_to_device_ratio=2.0, host_size=0, page_size=4,
                                layout="page_head", pin_memory=False, device="cpu", io_backend="kernel")
    assert (host.size, host.layout, host.pin_memory, host.device) == (64, HostLayout.PAGE_HEAD, False, "cpu")
    assert (host.head_num, host.head_dim, host.v_head_dim, host.dtype) == (2, 8, 8, torch.float16)
    assert isinstance(host.kv_buffer, tuple) and host.kv_buffer == (host.k_buffer, host.v_buffer)
    assert host.k_buffer.shape == (16, 2, 4, 2, 8)  # page_head: (pages, heads, page, layers, dim)
    by_gb = MHATokenToKVPoolHost(dev, 2.0, 128 * 40 / 1e9, 4, "layer_first", False, io_backend="direct")
    assert by_gb.size == 40  # host_size (GB) wins over the ratio, rounded to whole pages
    with pytest.raises(ValueError, match="page_size 8 differs from the device pool's 4"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 8, "layer_first", io_backend="direct")


def test_mla_kv_buffer_is_the_latent_tensor():
    dev = make_device_pool(PoolKind.MLA, torch.bfloat16, page_size=4)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "page_first", False, "cpu", io_backend="kernel")
    assert host.kv_cache_dim == dev.kv_cache_dim == 12
    assert isinstance(host.kv_buffer, torch.Tensor) and host.kv_buffer.shape == (host.size, 2, 1, 12)
    assert host.get_host_buffers()[0].data_ptr() == host.kv_buffer.data_ptr()


def test_mamba_takes_upstreams_order_without_page_size():
    dev = make_device_pool(PoolKind.MAMBA, torch.float32, page_size=1)
    # upstream's order: device_pool, host_to_device_ratio, host_size, pin_memory, device, allocator_type, layout
    host = MambaPoolHost(dev, 3.0, 0, False, "cpu", "default", "layer_first", io_backend="direct")
    assert (host.size, host.page_size, host.layout) == (3 * dev.size, 1, HostLayout.LAYER_FIRST)
    assert host.temporal_buffer is host.kv_buffer[0] and host.conv_buffer == list(host.kv_buffer[1:])
    assert [b.shape for b in host.conv_buffer] == [(2, host.size, 3, 4), (2, host.size, 2, 6)]
    assert MambaPoolHost(dev, 2.0, io_backend="direct").layout is HostLayout.PAGE_FIRST_DIRECT  # our default
