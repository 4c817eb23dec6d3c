"""Rotary embedding, RMSNorm, batch-invariant linear, and TP weight loaders (each rank's
shard, including KV-head replication when tp_size > num_kv_heads)."""

import math
from contextlib import contextmanager

import pytest
import torch

from sglang.srt.distributed import parallel_state
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    gemm_rows,
    invariant_linear,
)
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@contextmanager
def tp_coordinates(rank, size):
    """Pretend to be rank ``rank`` of ``size`` while building layers (loaders need no comms)."""
    saved = parallel_state._TP
    parallel_state._TP = parallel_state.GroupCoordinator(rank, size)
    try:
        yield
    finally:
        parallel_state._TP = saved


def hf_rope(x, positions, base, inv_freq=None):
    """The HF reference: rotate_half with cat(freqs, freqs), float64."""
    d = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.double().unsqueeze(1) * inv_freq.double()
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    x1, x2 = x.double().chunk(2, -1)
    return x.double() * cos + torch.cat([-x2, x1], -1) * sin


def test_rotary_matches_hf_reference():
    rope = RotaryEmbedding(16, 64, 10000.0)
    pos = torch.tensor([0, 1, 5, 63])
    q, k = torch.randn(4, 3, 16), torch.randn(4, 2, 16)
    rq, rk = rope(pos, q, k)
    torch.testing.assert_close(rq.double(), hf_rope(q, pos, 10000.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk.double(), hf_rope(k, pos, 10000.0), atol=1e-5, rtol=1e-5)


def test_llama3_rope_scaling_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    rope = RotaryEmbedding(16, 64, 500000.0, scaling)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    wavelen = 2 * math.pi / inv
    expected = []
    for f, w in zip(inv.tolist(), wavelen.tolist()):
        if w < 32 / 4:
            expected.append(f)
        elif w > 32 / 1:
            expected.append(f / 8)
        else:
            s = (32 / w - 1) / (4 - 1)
            expected.append((1 - s) * f / 8 + s * f)
    pos = torch.tensor([3, 40])
    q = torch.randn(2, 1, 16)
    torch.testing.assert_close(rope(pos, q, q)[0].double(), hf_rope(q, pos, 0, torch.tensor(expected)), atol=1e-5, rtol=1e-5)


def test_unknown_rope_type_lists_supported():
    with pytest.raises(ValueError, match=r"unsupported rope_scaling type 'longrope'.*llama3.*yarn"):
        RotaryEmbedding(16, 8, 1e4, {"rope_type": "longrope", "factor": 2})


def test_rmsnorm_and_fused_residual():
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 8)
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))


def test_gemm_rows_rounds_up_to_whole_tiles_of_min_gemm_rows():
    assert [gemm_rows(n) for n in (0, 1, 15, 16, 17, 32, 33, 250)] == [16, 16, 16, 16, 32, 32, 48, 256]


@pytest.mark.parametrize("in_features", [64, 256, 1536])
def test_invariant_linear_rows_do_not_depend_on_row_count(in_features):
    # K >= 128 is where small-row kernels of AVX-512/AMX machines round differently
    w, x = torch.randn(96, in_features), torch.randn(80, in_features)
    full = invariant_linear(x, w)
    for start in (0, 5):
        for n in range(1, 40):
            assert torch.equal(invariant_linear(x[start:start + n], w), full[start:start + n]), (start, n)


@pytest.mark.parametrize("tp_size,kv_heads", [(2, 2), (4, 2), (2, 1)])
def test_qkv_shards_cover_heads_and_replicate_kv(tp_size, kv_heads):
    heads, d, hidden = 4, 3, 5
    full = {n: torch.randn(rows * d, hidden) for n, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    q_parts, k_parts = [], []
    for rank in range(tp_size):
        with tp_coordinates(rank, tp_size):
            layer = QKVParallelLinear(hidden, d, heads, kv_heads)
        for shard_id, w in full.items():
            layer.weight_loader(layer.weight, w, shard_id)
        q, k, v = layer.weight.split([layer.num_heads * d, layer.num_kv_heads * d, layer.num_kv_heads * d])
        q_parts.append(q)
        k_parts.append(k)
        first_q_head = rank * layer.num_heads
        kv_head = first_q_head // (heads // kv_heads)  # the HF GQA grouping
        torch.testing.assert_close(k[:d], full["k"][kv_head * d : (kv_head + 1) * d])
        torch.testing.assert_close(v[:d], full["v"][kv_head * d : (kv_head + 1) * d])
    torch.testing.assert_close(torch.cat(q_parts), full["q"])
    if tp_size <= kv_heads:
        torch.testing.assert_close(torch.cat(k_parts), full["k"])


def test_merged_and_row_parallel_shards():
    gate, up, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    for rank in range(2):
        with tp_coordinates(rank, 2):
            merged = MergedColumnParallelLinear(4, [8, 8])
            row = RowParallelLinear(8, 4, bias=True)
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up, 1)
        torch.testing.assert_close(merged.weight, torch.cat([gate[rank * 4 : rank * 4 + 4], up[rank * 4 : rank * 4 + 4]]))
        row.weight_loader(row.weight, down)
        row.weight_loader(row.bias, torch.arange(4.0))
        torch.testing.assert_close(row.weight, down[:, rank * 4 : rank * 4 + 4])
        torch.testing.assert_close(row.bias, torch.arange(4.0))


def test_vocab_parallel_rows_and_padding():
    full = torch.randn(5, 3)
    with tp_coordinates(1, 2):
        emb = VocabParallelEmbedding(5, 3)
    emb.weight_loader(emb.weight, full)
    assert (emb.vocab_start, emb.vocab_end) == (3, 5)
    torch.testing.assert_close(emb.weight, torch.cat([full[3:], torch.zeros(1, 3)]))


def test_indivisible_heads_name_the_field():
    with tp_coordinates(0, 3), pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 2, 4, 2)
    with tp_coordinates(0, 4), pytest.raises(ValueError, match="multiple of it"):
        QKVParallelLinear(8, 2, 12, 3)
