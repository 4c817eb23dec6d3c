"""sgl-kernel's kvcacheio op names (``kvcacheio/ops.py``): each op against a per-token reference.

Device layers are separate tensors (as upstream's pools keep them) or views of one layer-major
tensor (as ours do); the kernel ops run under Triton's interpreter and through the torch
stand-in, the direct ops through the native helper and the torch page-row path.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang.srt.mem_cache.kvcacheio import direct, kernel, ops
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

L, SLOTS, H, D, P = 3, 32, 2, 6, 4
HOST_PAGES = [5, 0, 3]  # unsorted, not contiguous
DEV_PAGES = [2, 7, 4]


def token_slots(pages):
    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


HOST_IDX, DEV_IDX = token_slots(HOST_PAGES), token_slots(DEV_PAGES)


def device_layers(stacked: bool, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if stacked:
        return list(torch.randn(L, SLOTS, H, D, generator=gen).to(dtype).unbind(0))
    return [torch.randn(SLOTS, H, D, generator=gen).to(dtype) for _ in range(L)]


def table(layers):
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


@pytest.fixture(params=["triton-interpreter", "torch-gather"])
def kernel_path(request, monkeypatch):
    if request.param == "torch-gather":
        monkeypatch.setattr(kernel, "triton_usable", lambda device: False)
    return request.param


@pytest.mark.parametrize("stacked", [True, False], ids=["views", "separate"])
def test_kernel_ops_round_trip_page_first(kernel_path, stacked):
    layers = device_layers(stacked)
    item = H * D * 2
    host = torch.zeros(SLOTS, L, H, D, dtype=torch.bfloat16)
    ops.transfer_kv_all_layer_mla_lf_pf(src_layers=table(layers), dst=host, src_indices=DEV_IDX,
                                        dst_indices=HOST_IDX, item_size=item, dst_layout_dim=item * L, num_layers=L)
    for layer in range(L):
        assert torch.equal(host[HOST_IDX, layer], layers[layer][DEV_IDX])
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[HOST_IDX] = False
    assert not host[untouched].any()

    back = [torch.zeros(SLOTS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    for layer in range(L):
        ops.transfer_kv_per_layer_mla_pf_lf(src=host, dst=back[layer], src_indices=HOST_IDX, dst_indices=DEV_IDX,
                                            layer_id=layer, item_size=item, src_layout_dim=item * L)
        assert torch.equal(back[layer][DEV_IDX], layers[layer][DEV_IDX])
        assert not back[layer][token_slots([0, 1])].any()


@pytest.mark.parametrize("staging_tokens", [P, 2 * P + 1, 16 * P])  # chunks of 1 page, 2 pages, the whole job
def test_staged_backup_matches_the_direct_kernel_backup(staging_tokens):
    layers = device_layers(False, torch.float16, seed=1)
    item = H * D * 2
    want = torch.zeros(SLOTS, L, H, D, dtype=torch.float16)
    ops.transfer_kv_all_layer_mla_lf_pf(src_layers=table(layers), dst=want, src_indices=DEV_IDX,
                                        dst_indices=HOST_IDX, item_size=item, dst_layout_dim=item * L, num_layers=L)
    got = torch.zeros_like(want)
    staging = torch.empty(staging_tokens, L, H, D, dtype=torch.float16)
    ops.transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src=table(layers), src_indices=DEV_IDX,
                                                    dst_indices=HOST_IDX, staging=staging, dst=got, page_size=P)
    assert torch.equal(got, want)


def test_staging_must_match_the_host_rows():
    layers = device_layers(False)
    host = torch.zeros(SLOTS, L, H, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match host rows"):
        ops.transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src=table(layers), src_indices=DEV_IDX,
                                                        dst_indices=HOST_IDX, dst=host, page_size=P,
                                                        staging=torch.empty(P, L, H, D + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="less than one page"):
        ops.transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src=table(layers), src_indices=DEV_IDX,
                                                        dst_indices=HOST_IDX, dst=host, page_size=P,
                                                        staging=torch.empty(P - 1, L, H, D, dtype=torch.bfloat16))


def test_byte_geometry_is_checked_before_a_copy():
    layers = device_layers(True)
    host = torch.zeros(SLOTS, L, H, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="item_size is 7 bytes"):
        ops.transfer_kv_per_layer_mla_pf_lf(src=host, dst=layers[0], src_indices=HOST_IDX, dst_indices=DEV_IDX,
                                            layer_id=0, item_size=7, src_layout_dim=7 * L)
    with pytest.raises(ValueError, match="device rows hold 12 elements, item_size says 6"):
        ops.transfer_kv_per_layer_mla_pf_lf(src=host, dst=layers[0], src_indices=HOST_IDX, dst_indices=DEV_IDX,
                                            layer_id=0, item_size=12, src_layout_dim=12 * L)
    with pytest.raises(ValueError, match="must hold 3 uint64 addresses"):
        ops.transfer_kv_all_layer_mla_lf_pf(src_layers=table(layers)[:2], dst=host, src_indices=DEV_IDX,
                                            dst_indices=HOST_IDX, item_size=24, dst_layout_dim=72, num_layers=L)
    assert not host.any()


@pytest.fixture(params=["native", "page-rows"])
def direct_path(request, monkeypatch):
    if request.param == "page-rows":
        monkeypatch.setattr(direct, "NATIVE_COPY", False)
    elif not direct.NATIVE_COPY:
        pytest.skip("the native copy helper is not built here")
    return request.param


@pytest.mark.parametrize("stacked", [True, False], ids=["views", "separate"])
def test_direct_ops_round_trip_page_first_direct(direct_path, stacked):
    k_layers, v_layers = device_layers(stacked, seed=2), device_layers(stacked, seed=3)
    k_host = torch.zeros(SLOTS // P, L, P, H, D, dtype=torch.bfloat16)
    v_host = torch.zeros_like(k_host)
    ops.transfer_kv_all_layer_direct_lf_pf(src_ptrs=k_layers + v_layers, dst_ptrs=[k_host, v_host],
                                           src_indices=DEV_IDX, dst_indices=HOST_IDX, page_size=P)
    pages = torch.tensor(HOST_PAGES)
    for layer in range(L):
        assert torch.equal(k_host[pages, layer].reshape(-1, H, D), k_layers[layer][DEV_IDX])
        assert torch.equal(v_host[pages, layer].reshape(-1, H, D), v_layers[layer][DEV_IDX])
    assert not k_host[torch.tensor([1, 2, 4, 6, 7])].any()

    back = torch.zeros(L, SLOTS, H, D, dtype=torch.bfloat16)
    for layer in range(L):
        ops.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[k_host], dst_ptrs=[back[layer]], src_indices=HOST_IDX,
                                               dst_indices=DEV_IDX, layer_id=layer, page_size=P)
        assert torch.equal(back[layer][DEV_IDX], k_layers[layer][DEV_IDX])
    assert not back[:, token_slots([0, 1, 3])].any()


def test_stacked_layers_are_recognised_only_back_to_back():
    base = torch.zeros(L, SLOTS, H, D)
    stacked = ops._stacked(list(base.unbind(0)))
    assert stacked is not None and stacked.data_ptr() == base.data_ptr() and stacked.shape == base.shape
    assert ops._stacked([base[0], base[2]]) is None  # a gap
    assert ops._stacked([base[1], base[0]]) is None  # out of order
    assert ops._stacked([torch.zeros(SLOTS, H, D) for _ in range(L)]) is None  # separate storages


def test_direct_ops_refuse_mismatched_lists():
    layers = device_layers(True)
    host = torch.zeros(SLOTS // P, L, P, H, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not split over 2 host buffers"):
        ops.transfer_kv_all_layer_direct_lf_pf(src_ptrs=layers, dst_ptrs=[host, host], src_indices=DEV_IDX,
                                               dst_indices=HOST_IDX, page_size=P)
    with pytest.raises(ValueError, match="page_first_direct tensor must be contiguous"):
        ops.transfer_kv_per_layer_direct_pf_lf(src_ptrs=[host], dst_ptrs=[layers[0]], src_indices=HOST_IDX,
                                               dst_indices=DEV_IDX, layer_id=0, page_size=P * 2)
