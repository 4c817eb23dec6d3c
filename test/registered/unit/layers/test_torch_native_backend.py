"""Paged attention in torch: equals dense causal attention, and a token's output is bitwise
the same however its batch is composed (prefill chunk, decode step, other requests)."""

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend, tree_sum_blocks
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool.mha import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")
register_cuda_ci(est_time=15, suite="per-commit-1-gpu")

DEVICE = os.environ.get("SGLANG_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
HEADS, KV_HEADS, HEAD_DIM, LAYER = 4, 2, 16, 0


class Harness:
    """A real pool, allocator, request table and backend; ``runner`` is the bundle
    ForwardBatch reads them from."""

    def __init__(self, page_size=1, key_block=8, q_block=5, size=512, num_layers=1):
        pool = MHATokenToKVPool(size, page_size, torch.float32, KV_HEADS, HEAD_DIM, num_layers, DEVICE)
        self.allocator = PagedTokenToKVPoolAllocator(size, page_size, kvcache=pool)
        self.runner = SimpleNamespace(
            device=torch.device(DEVICE),
            token_to_kv_pool=pool,
            req_to_token_pool=ReqToTokenPool(8, 256, DEVICE),
            attn_backend=TorchNativeAttnBackend(DEVICE, key_block=key_block, q_block=q_block),
            model_config=SimpleNamespace(vocab_size=100),
        )
        self.layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, LAYER)

    def slots(self, n):
        page = self.allocator.page_size
        loc = self.allocator.alloc(-(-n // page) * page)
        return loc[torch.randperm(loc.numel(), generator=torch.Generator().manual_seed(n))][:n]

    def run(self, batch, q, k, v):
        backend = self.runner.attn_backend
        backend.init_forward_metadata(batch)
        return backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), self.layer, batch).cpu()


def qkv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=g))


def dense_reference(q, k, v, first_pos):
    """Causal GQA attention in float64: q rows sit at positions first_pos.. over keys 0.."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    pos = torch.arange(first_pos, first_pos + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def extend(h, reqs):
    """reqs: list of (req_idx, prefix_len, q, k, v, slots_of_new_tokens)."""
    batch = ForwardBatch.init_extend(
        h.runner, [r[0] for r in reqs], [r[1] for r in reqs], [[1] * r[2].shape[0] for r in reqs],
        torch.cat([r[5] for r in reqs]),
    )
    return h.run(batch, *(torch.cat([r[i] for r in reqs]) for i in (2, 3, 4)))


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_with_cached_prefix_equals_dense(page_size):
    h = Harness(page_size=page_size)
    q, k, v = qkv(37, seed=1)
    slots = h.slots(37)
    extend(h, [(0, 0, q[:20], k[:20], v[:20], slots[:20])])  # the prefix, computed earlier
    out = extend(h, [(0, 20, q[20:], k[20:], v[20:], slots[20:])])
    torch.testing.assert_close(out.double(), dense_reference(q[20:], k, v, 20), atol=1e-5, rtol=1e-5)


def test_decode_batch_equals_dense_per_request():
    h = Harness()
    lens, reqs, data = [9, 30, 1], [], []
    for r, n in enumerate(lens):
        q, k, v = qkv(n + 1, seed=10 + r)
        slots = h.slots(n + 1)
        extend(h, [(r, 0, q[:n], k[:n], v[:n], slots[:n])])
        reqs.append((r, n, q[n:], k[n:], v[n:], slots[n:]))
        data.append((q, k, v))
    batch = ForwardBatch.init_decode(h.runner, [0, 1, 2], [1, 1, 1], [n + 1 for n in lens], torch.cat([r[5] for r in reqs]))
    out = h.run(batch, *(torch.cat([r[i] for r in reqs]) for i in (2, 3, 4)))
    for r, n in enumerate(lens):
        q, k, v = data[r]
        torch.testing.assert_close(out[r : r + 1].double(), dense_reference(q[n:], k, v, n), atol=1e-5, rtol=1e-5)


def test_token_output_is_bitwise_batch_invariant():
    """Token 25 of a request: in one prefill of 40, as a decode step after 25 cached tokens,
    in a chunk 18..30 next to another request. CPU/MKL: identical bits; CUDA: close."""
    q, k, v = qkv(40, seed=3)
    other = qkv(11, seed=4)
    h1 = Harness()
    s1 = h1.slots(40)
    full = extend(h1, [(0, 0, q, k, v, s1)])[25]

    h2 = Harness(page_size=4)
    s2 = h2.slots(26)
    extend(h2, [(1, 0, q[:25], k[:25], v[:25], s2[:25])])
    batch = ForwardBatch.init_decode(h2.runner, [1], [1], [26], s2[25:])
    decode = h2.run(batch, q[25:26], k[25:26], v[25:26])[0]

    h3 = Harness()
    s3, so = h3.slots(30), h3.slots(11)
    extend(h3, [(2, 0, q[:18], k[:18], v[:18], s3[:18])])
    mixed = extend(h3, [(3, 0, *other, so), (2, 18, q[18:30], k[18:30], v[18:30], s3[18:])])[11 + 7]
    for other_way in (decode, mixed):
        if DEVICE == "cpu":
            assert torch.equal(full, other_way)
        else:
            torch.testing.assert_close(full, other_way, atol=1e-5, rtol=1e-5)


def test_reads_kv_through_pool_once_per_layer():
    """Attention for layer i must wait on the pool's LayerDoneCounter for layer i (HiCache load)."""
    h = Harness(num_layers=2)
    waits = []
    h.runner.token_to_kv_pool.register_layer_transfer_counter(SimpleNamespace(wait_until=waits.append))
    q, k, v = qkv(6, seed=5)
    batch = ForwardBatch.init_extend(h.runner, [0], [0], [[1] * 6], h.slots(6))
    for layer_id in (0, 1):
        h.layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer_id)
        h.run(batch, q, k, v)
    assert waits == [0, 0, 1, 1]  # key buffer then value buffer, per layer


def test_tree_sum_ignores_trailing_zero_blocks():
    x = torch.randn(2, 5, 3, 4, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([x, torch.zeros(2, 11, 3, 4)], dim=1)
    assert torch.equal(tree_sum_blocks(x), tree_sum_blocks(padded))
    torch.testing.assert_close(tree_sum_blocks(x), x.sum(1))


@settings(max_examples=25, deadline=None)
@given(
    prefix=st.integers(0, 40),
    new=st.integers(1, 30),
    page_size=st.sampled_from([1, 2, 8]),
    key_block=st.sampled_from([1, 4, 16, 128]),
    q_block=st.sampled_from([1, 3, 512]),
)
def test_random_shapes_match_dense(prefix, new, page_size, key_block, q_block):
    h = Harness(page_size=page_size, key_block=key_block, q_block=q_block)
    q, k, v = qkv(prefix + new, seed=prefix * 100 + new)
    slots = h.slots(prefix + new)
    if prefix:
        extend(h, [(0, 0, q[:prefix], k[:prefix], v[:prefix], slots[:prefix])])
    out = extend(h, [(0, prefix, q[prefix:], k[prefix:], v[prefix:], slots[prefix:])])
    torch.testing.assert_close(out.double(), dense_reference(q[prefix:], k, v, prefix), atol=1e-5, rtol=1e-5)
