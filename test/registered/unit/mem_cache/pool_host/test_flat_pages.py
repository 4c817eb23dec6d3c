"""Flat pages, page buffer metadata and stride alignment, against real addresses."""

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry, PoolName
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool, make_host_pool, randomize_bytes

register_cpu_ci(est_time=15, suite="per-commit-cpu")

LAYOUT_CELLS = sorted(
    {(k, lay) for (k, lay, _) in IO_TABLE if k is not PoolKind.DSV4_ANCHOR}, key=lambda c: (c[0].value, c[1].value)
)


def backend_for(kind, layout):
    return next(io for (k, lay, io) in IO_TABLE if (k, lay) == (kind, layout))


def build(kind, layout, page_size=4, dtype=torch.bfloat16):
    dev = make_device_pool(kind, dtype, 1 if kind is PoolKind.MAMBA else page_size)
    host = make_host_pool(dev, layout, backend_for(kind, layout))
    for comp in host.components:
        randomize_bytes(host.host_buffer(comp.name), torch.Generator().manual_seed(7))
    return host


def read_at(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


@pytest.mark.parametrize("cell", LAYOUT_CELLS, ids=lambda c: f"{c[0].value}-{c[1].value}")
def test_flat_page_equals_bytes_at_meta_pointers(cell):
    host = build(*cell)
    P = host.page_size
    pages = [3, 0, 5]
    idx = torch.tensor([p * P + t for p in pages for t in range(P)])
    ptrs, sizes = host.get_page_buffer_meta(idx)
    per_page = host.buffers_per_page()
    assert len(ptrs) == len(sizes) == per_page * len(pages)
    for i, page in enumerate(pages):
        flat = host.get_data_page(page * P)
        assert flat.dtype == torch.uint8 and flat.numel() == host.page_bytes
        at_ptrs = b"".join(read_at(p, s) for p, s in zip(ptrs[i * per_page : (i + 1) * per_page], sizes[i * per_page :]))
        assert at_ptrs == flat.numpy().tobytes()


@pytest.mark.parametrize("cell", LAYOUT_CELLS, ids=lambda c: f"{c[0].value}-{c[1].value}")
def test_set_from_flat_page_reproduces_the_page(cell):
    host = build(*cell)
    P = host.page_size
    src_page, dst_page, other = 2, 6, 4
    other_before = host.get_data_page(other * P).clone()
    host.set_from_flat_data_page(dst_page * P, host.get_data_page(src_page * P))
    assert torch.equal(host.get_data_page(dst_page * P), host.get_data_page(src_page * P))
    assert torch.equal(host.get_data_page(other * P), other_before)
    dummy = host.get_dummy_flat_data_page()
    assert dummy.dtype == torch.uint8 and dummy.numel() == host.page_bytes and not dummy.any()


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_flat_page_layer_first_and_page_first_direct_share_a_format(data):
    """layer_first and page_first_direct write the same bytes for the same KV (same page_format)."""
    P = data.draw(st.sampled_from([1, 2, 4]))
    dev = make_device_pool(PoolKind.MHA, torch.float16, P)
    randomize_bytes(dev.buffers["k"], torch.Generator().manual_seed(1))
    randomize_bytes(dev.buffers["v"], torch.Generator().manual_seed(2))
    lf = make_host_pool(dev, "layer_first", "direct")
    pfd = make_host_pool(dev, "page_first_direct", "direct")
    pf = make_host_pool(dev, "page_first", "kernel")
    page = data.draw(st.integers(1, 7))
    d_idx = torch.arange(page * P, (page + 1) * P)
    h_idx = torch.arange(0, P)
    for h in (lf, pfd, pf):
        h.backup_from_device_all_layer(dev, h_idx, d_idx)
    assert lf.page_format == pfd.page_format != pf.page_format
    assert torch.equal(lf.get_data_page(0), pfd.get_data_page(0))
    assert not torch.equal(lf.get_data_page(0), pf.get_data_page(0)) or P == 1


def test_flat_page_bad_input():
    host = build(PoolKind.MHA, HostLayout.PAGE_FIRST_DIRECT)
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        host.get_data_page(2)
    with pytest.raises(ValueError, match="in \\[0, 64\\)"):
        host.get_data_page(64)
    before = host.get_data_page(8).clone()
    with pytest.raises(ValueError, match="uint8 of 512 bytes"):
        host.set_from_flat_data_page(8, torch.zeros(511, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        host.set_from_flat_data_page(8, torch.zeros(256, dtype=torch.float16))
    assert torch.equal(host.get_data_page(8), before)


def expected_alignment(host, alignment):
    """Recompute from the real addresses: every page buffer start, and page-to-page stride."""
    P = host.page_size
    all_ptrs, _ = host.get_page_buffer_meta(torch.arange(host.size))
    per = host.buffers_per_page()
    for j in range(per):
        col = all_ptrs[j::per]
        if any(p % alignment for p in col):
            return False
        if any((b - a) % alignment for a, b in zip(col, col[1:])):
            return False
    return True


ALIGN_CASES = [
    # (kind, layout, dtype, page_size)
    (PoolKind.MHA, HostLayout.PAGE_FIRST_DIRECT, torch.float32, 64),  # page = 2*8*64*4*2 B per comp
    (PoolKind.MHA, HostLayout.PAGE_FIRST_DIRECT, torch.bfloat16, 4),  # 256 B pages: misaligned
    (PoolKind.MHA, HostLayout.LAYER_FIRST, torch.float32, 64),  # per-layer chunk 4096 B
    (PoolKind.MHA, HostLayout.LAYER_FIRST, torch.float32, 16),
    (PoolKind.MHA, HostLayout.PAGE_HEAD, torch.float32, 64),
    (PoolKind.MHA, HostLayout.PAGE_FIRST, torch.float16, 64),
    (PoolKind.MLA, HostLayout.PAGE_FIRST_DIRECT, torch.float32, 64),
    (PoolKind.MLA, HostLayout.PAGE_FIRST_DIRECT, torch.bfloat16, 64),
    (PoolKind.ASYMMETRIC_MHA, HostLayout.PAGE_FIRST_DIRECT, torch.float32, 64),
    (PoolKind.DSA_INDEXER, HostLayout.PAGE_FIRST_DIRECT, torch.float32, 64),
    (PoolKind.DSV4_STATE, HostLayout.PAGE_FIRST_DIRECT, torch.bfloat16, 64),
    (PoolKind.MAMBA, HostLayout.PAGE_FIRST_DIRECT, torch.bfloat16, 1),
]


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: f"{c[0].value}-{c[1].value}-{c[2]}-P{c[3]}")
def test_is_stride_page_aligned_matches_real_addresses(case):
    kind, layout, dtype, P = case
    dev = make_device_pool(kind, dtype, P)
    host = make_host_pool(dev, layout, backend_for(kind, layout))
    for alignment in (512, 4096):
        assert host.is_stride_page_aligned(page_size_bytes=alignment) == expected_alignment(host, alignment)
    # every buffer starts on a 4096 boundary (mmap memory), whatever the stride
    assert all(b.data_ptr() % 4096 == 0 for b in host.get_host_buffers())


def test_alignment_true_and_false_cases_exist():
    results = {}
    for kind, layout, dtype, P in ALIGN_CASES:
        host = make_host_pool(make_device_pool(kind, dtype, P), layout, backend_for(kind, layout))
        results[(kind, layout, dtype, P)] = host.is_stride_page_aligned(4096)
    assert results[(PoolKind.MHA, HostLayout.PAGE_FIRST_DIRECT, torch.float32, 64)] is True
    assert results[(PoolKind.MHA, HostLayout.PAGE_FIRST_DIRECT, torch.bfloat16, 4)] is False
    assert results[(PoolKind.MHA, HostLayout.LAYER_FIRST, torch.float32, 16)] is False


def test_group_alignment_is_the_and_of_members():
    from sglang.srt.mem_cache.memory_pool import DeepSeekV4StatePool

    P = 64
    kv_dev = make_device_pool(PoolKind.MHA, torch.float32, P)
    kv = make_host_pool(kv_dev, "page_first_direct", "direct")
    state_dev = DeepSeekV4StatePool(8 * P, P, 32, 2, torch.float32)  # 32 fp32 per row: 16 KiB pages
    aligned_side = make_host_pool(state_dev, "page_first_direct", "direct", size=kv.size)
    idx_dev = make_device_pool(PoolKind.DSA_INDEXER, torch.float32, P)  # fp32 scale pages: 512 B
    misaligned_side = make_host_pool(idx_dev, "page_first_direct", "direct", size=kv.size)
    anchor_dev = make_device_pool(PoolKind.DSV4_ANCHOR, page_size=P)
    logical = make_host_pool(anchor_dev, "page_first_direct", "direct", size=kv.size)
    assert kv.is_stride_page_aligned() and aligned_side.is_stride_page_aligned()
    assert not misaligned_side.is_stride_page_aligned()
    assert logical.is_stride_page_aligned()  # no buffers: nothing misaligned
    def group(anchor, anchor_dev, name, side, side_dev):
        return HostPoolGroup([PoolEntry(PoolName.KV, anchor, anchor_dev, is_primary_index_anchor=True),
                              PoolEntry(name, side, side_dev, shares_anchor_slots=True)])

    assert group(kv, kv_dev, PoolName.DSV4_STATE, aligned_side, state_dev).is_stride_page_aligned()
    assert not group(kv, kv_dev, PoolName.INDEXER, misaligned_side, idx_dev).is_stride_page_aligned()
    assert group(logical, anchor_dev, PoolName.DSV4_STATE, aligned_side, state_dev).is_stride_page_aligned()
    v4_bad = group(logical, anchor_dev, PoolName.INDEXER, misaligned_side, idx_dev)
    assert not v4_bad.is_stride_page_aligned()
