"""Device pools: geometry, reads/writes per layer, buffer infos for PD, bad construction."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import (
    AsymmetricMHATokenToKVPool,
    DeepSeekV4StatePool,
    DSAIndexerPool,
    LogicalAnchorPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def test_mha_set_and_get():
    pool = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 3, start_layer=5)
    assert pool.get_key_buffer(5).shape == (20, 2, 8)
    loc = torch.tensor([4, 9])
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    pool.set_kv_buffer(6, loc, k, v)
    assert torch.equal(pool.get_key_buffer(6)[loc], k.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(6)[loc], v.to(torch.bfloat16))
    assert not pool.get_key_buffer(5).any()
    with pytest.raises(ValueError, match="layer_id 8 outside \\[5, 8\\)"):
        pool.get_key_buffer(8)
    assert pool.get_size_per_token() == 2 * 3 * 2 * 8 * 2


def test_fp8_is_stored_as_bytes():
    fp8 = torch.float8_e4m3fn
    pool = MHATokenToKVPool(8, 4, fp8, 1, 4, 1)
    assert pool.buffers["k"].dtype == torch.uint8
    pool.set_kv_buffer(0, torch.tensor([4]), torch.ones(1, 1, 4), torch.ones(1, 1, 4))
    assert pool.get_key_buffer(0).dtype == fp8
    assert pool.get_key_buffer(0)[4].float().eq(1).all()


def test_mla_and_asymmetric_geometry():
    mla = MLATokenToKVPool(8, 4, torch.float16, 16, 4, 2)
    assert mla.get_key_buffer(0).shape == (12, 1, 20)
    assert mla.get_value_buffer(0).shape == (12, 1, 16)
    mla.set_mla_kv_buffer(1, torch.tensor([5]), torch.ones(1, 1, 16), torch.full((1, 1, 4), 2.0))
    assert mla.get_key_buffer(1)[5, 0, 15] == 1 and mla.get_key_buffer(1)[5, 0, 16] == 2
    asym = AsymmetricMHATokenToKVPool(8, 4, torch.float16, 2, 16, 8, 2)
    assert asym.get_key_buffer(0).shape == (12, 2, 16) and asym.get_value_buffer(0).shape == (12, 2, 8)
    with pytest.raises(ValueError, match="v_head_dim != head_dim"):
        AsymmetricMHATokenToKVPool(8, 4, torch.float16, 2, 16, 16, 2)


def test_state_and_sidecar_pools():
    mamba = MambaPool(4, [(3, 8)], (2, 4, 4), 2)
    assert mamba.temporal.shape == (2, 5, 2, 4, 4) and mamba.conv[0].shape == (2, 5, 3, 8)
    assert mamba.alloc(2).tolist() == [1, 2] and mamba.available_size() == 2
    dsa = DSAIndexerPool(8, 4, 16, 2)
    assert [c.name for c in dsa.components] == ["index_k", "index_scale"]
    assert dsa.get_size_per_token() == 2 * (16 * 2 + 4)
    anchor = LogicalAnchorPool(8, 4, 2)
    assert anchor.get_size_per_token() == 0 and anchor.buffers == {}
    state = DeepSeekV4StatePool(8, 4, 24, 2)
    assert state.get_state_buffer(1).shape == (12, 24)


def test_contiguous_buf_infos_address_every_layer():
    pool = MHATokenToKVPool(8, 4, torch.float32, 2, 4, 3)
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    assert len(ptrs) == 6  # K layers then V layers
    assert ptrs[0] == pool.buffers["k"].data_ptr() and ptrs[3] == pool.buffers["v"].data_ptr()
    assert ptrs[1] - ptrs[0] == lens[0] == 12 * 2 * 4 * 4
    assert set(item_lens) == {2 * 4 * 4}


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: MHATokenToKVPool(10, 4, torch.float16, 2, 8, 2), "multiple of page_size 4"),
        (lambda: MHATokenToKVPool(8, 0, torch.float16, 2, 8, 2), "page_size must be >= 1"),
        (lambda: MHATokenToKVPool(8, 4, torch.float16, 2, 8, 0), "layer_num must be >= 1"),
        (lambda: MHATokenToKVPool(8, 4, torch.float16, 0, 8, 2), "item_shape must be positive"),
        (lambda: MambaPool(4, [], (2, 4), 2), "at least one conv state"),
    ],
)
def test_bad_construction(build, fragment):
    with pytest.raises(ValueError, match=fragment):
        build()
