"""The asymmetric MHA host pool: K and V with their own dims, on upstream's surface.

Its ``page_first`` + ``kernel`` and ``page_first_direct`` + ``direct`` cells go through the
sgl-kernel op names (``kvcacheio/ops.py``) with the device pool's per-layer lists and address
tables; these tests run them on real pools against a per-token reference, with and without the
staged write-back, and check what is refused before a byte moves.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import AsymmetricMHATokenToKVPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import mha
from sglang.srt.mem_cache.pool_host.mha import (
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import host_item

register_cpu_ci(est_time=10, suite="per-commit-cpu")

P, LAYERS, HEADS, K_DIM, V_DIM = 4, 3, 2, 8, 4
OP_CELLS = [("page_first", "kernel"), ("page_first_direct", "direct")]


def device_pool(seed=0):
    pool = AsymmetricMHATokenToKVPool(8 * P, P, torch.bfloat16, HEADS, K_DIM, V_DIM, LAYERS)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.buffers.values():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    return pool


def slots(pages):
    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


def test_factory_picks_the_pool_by_kv_dims():
    assert get_mha_host_pool_cls(MHATokenToKVPool(8, 4, torch.float16, 2, 8, 1)) is MHATokenToKVPoolHost
    assert get_mha_host_pool_cls(device_pool()) is AsymmetricMHATokenToKVPoolHost


def test_upstream_positional_constructor_and_geometry():
    dev = device_pool()
    # upstream's order: device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory, device
    host = AsymmetricMHATokenToKVPoolHost(dev, 2.0, 0, P, "page_first", False, "cpu", io_backend="kernel")
    assert (host.size, host.page_num, host.head_num, host.head_dim, host.v_head_dim) == (64, 16, HEADS, K_DIM, V_DIM)
    assert host.k_buffer is host.kv_buffer[0] and host.v_buffer is host.kv_buffer[1]
    assert host.k_buffer.shape == (64, LAYERS, HEADS, K_DIM) and host.v_buffer.shape == (64, LAYERS, HEADS, V_DIM)
    assert host.get_ksize_per_token() == HEADS * K_DIM * 2 * LAYERS
    assert not host.can_use_write_back_jit and host.staging_k_buffer is None  # CPU platform: no staging
    with pytest.raises(ValueError, match="device must be 'cpu'"):
        AsymmetricMHATokenToKVPoolHost(dev, 2.0, 0, P, "page_first", False, "cuda", io_backend="kernel")
    with pytest.raises(ValueError, match="allocator_type must be 'default'"):
        AsymmetricMHATokenToKVPoolHost(dev, 2.0, 0, P, "page_first", False, "cpu", "mooncake", io_backend="kernel")


@pytest.mark.parametrize("layout,io", OP_CELLS)
def test_op_cells_round_trip_against_the_reference(layout, io):
    src, dst = device_pool(1), device_pool(2)
    host = AsymmetricMHATokenToKVPoolHost(src, 2.0, layout=layout, io_backend=io)
    h_idx, s_idx, d_idx = slots([9, 2, 5]), slots([3, 1, 6]), slots([7, 2, 4])
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    for layer in range(LAYERS):
        for slot, dev_slot in zip(h_idx.tolist(), s_idx.tolist()):
            assert torch.equal(host_item(host, "k", slot, layer), src.buffers["k"][layer, dev_slot])
            assert torch.equal(host_item(host, "v", slot, layer), src.buffers["v"][layer, dev_slot])
    before = {n: b.clone() for n, b in dst.buffers.items()}
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dst, h_idx, d_idx, layer)
    for name in ("k", "v"):
        want = before[name].clone()
        want[:, d_idx] = src.buffers[name][:, s_idx]
        assert torch.equal(dst.buffers[name], want), name  # named slots copied, every other slot untouched


def test_staged_write_back_matches_the_plain_backup(monkeypatch):
    """Force the staged path on CPU (staging in host memory): same bytes as the table kernel."""
    src = device_pool(3)
    plain = AsymmetricMHATokenToKVPoolHost(src, 2.0, layout="page_first", io_backend="kernel")
    monkeypatch.setattr(mha, "_is_cuda", True)
    monkeypatch.setattr(mha, "current_platform", type("P", (), {"capabilities": type("C", (), {
        "hicache_device_kernels": True})()})())
    staged = AsymmetricMHATokenToKVPoolHost(src, 2.0, layout="page_first", io_backend="kernel")
    assert staged.can_use_write_back_jit and staged.staging_token_capacity == 16 * P
    assert staged.staging_k_buffer.shape == (16 * P, LAYERS, HEADS, K_DIM)
    staged.staging_k_buffer = staged.staging_k_buffer[: P + 1]  # several chunks per backup
    staged.staging_v_buffer = staged.staging_v_buffer[: 2 * P]
    h_idx, s_idx = slots([9, 2, 5, 11]), slots([3, 1, 6, 7])
    plain.backup_from_device_all_layer(src, h_idx, s_idx)
    staged.backup_from_device_all_layer(src, h_idx, s_idx)
    assert torch.equal(staged.k_buffer, plain.k_buffer) and torch.equal(staged.v_buffer, plain.v_buffer)
    assert plain.k_buffer[h_idx].any()


def test_a_replaced_buffer_serves_the_next_copy():
    src = device_pool(4)
    host = AsymmetricMHATokenToKVPoolHost(src, 2.0, layout="layer_first", io_backend="direct")
    host.backup_from_device_all_layer(src, slots([0]), slots([1]))  # builds the cached IO specs
    fresh = torch.zeros_like(host.k_buffer)
    host.k_buffer = fresh
    assert host.kv_buffer[0] is fresh
    host.backup_from_device_all_layer(src, slots([0]), slots([2]))
    assert torch.equal(fresh[:, slots([0])], src.buffers["k"][:, slots([2])])


@pytest.mark.parametrize("layout,io", OP_CELLS)
def test_bad_copies_are_refused_before_a_byte_moves(layout, io):
    src = device_pool(5)
    host = AsymmetricMHATokenToKVPoolHost(src, 1.0, layout=layout, io_backend=io)
    wrong_dims = AsymmetricMHATokenToKVPool(8 * P, P, torch.bfloat16, HEADS, K_DIM, V_DIM + 2, LAYERS)
    with pytest.raises(ValueError, match=r"device V layer is \(36, 2, 6\)"):
        host.backup_from_device_all_layer(wrong_dims, slots([0]), slots([1]))
    with pytest.raises(ValueError, match="host indices out of range"):
        host.backup_from_device_all_layer(src, slots([8]), slots([1]))
    with pytest.raises(ValueError, match="device indices: a page is not 4 consecutive slots"):
        host.load_to_device_per_layer(src, slots([0]), torch.tensor([4, 5, 7, 6]), 0)
    with pytest.raises(ValueError, match=r"layer_id 3 outside \[0, 3\)"):
        host.load_to_device_per_layer(src, slots([0]), slots([1]), 3)
    assert not host.k_buffer.any() and not host.v_buffer.any()


def test_direct_on_page_first_names_the_layouts_it_needs():
    host = AsymmetricMHATokenToKVPoolHost(device_pool(), 2.0, layout="page_first", io_backend="kernel")
    with pytest.raises(ValueError, match="expected 'page_first_direct' or 'layer_first'"):
        host.backup_from_device_all_layer(host.device_pool, slots([0]), slots([1]), io_backend="direct")
