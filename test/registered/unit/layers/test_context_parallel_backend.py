"""Attention context parallelism in one process: two CP ranks' backends over their own pools and
the same page table; each writes only the K/V of the pages it owns (page round robin), and their
partial attentions combined equal dense causal attention, for a prefill over a cached prefix and
a decode step, each token's K/V written by the rank that runs it. Plus the --attn-cp-size combinations refused at startup. The served path (tokens
equal to --tp-size 1 and HF, HiCache per CP rank, seed 003's controllers) is
test/registered/hicache/test_context_parallel_nightly.py."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.context_parallel_backend import (
    ContextParallelAttnBackend,
    combine_partials,
    cp_owner,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool.mha import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

HEADS, KV_HEADS, HEAD_DIM, CP = 4, 2, 16, 2


def dense_reference(q, k, v, first_pos):
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    pos = torch.arange(first_pos, first_pos + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


class Ranks:
    """CP ranks in one process: a pool, request table and backend each, one allocator's slots."""

    def __init__(self, page_size):
        self.page_size = page_size
        self.allocator = PagedTokenToKVPoolAllocator(
            256, page_size, kvcache=MHATokenToKVPool(256, page_size, torch.float32, KV_HEADS, HEAD_DIM, 1))
        self.runners = []
        for rank in range(CP):
            group = SimpleNamespace(rank_in_group=rank, world_size=CP, device_group=None)
            self.runners.append(SimpleNamespace(
                device=torch.device("cpu"),
                token_to_kv_pool=MHATokenToKVPool(256, page_size, torch.float32, KV_HEADS, HEAD_DIM, 1),
                req_to_token_pool=ReqToTokenPool(4, 128, "cpu"),
                attn_backend=ContextParallelAttnBackend("cpu", page_size, group, key_block=8, q_block=5),
                model_config=SimpleNamespace(vocab_size=100),
            ))
        self.layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, 0)

    def slots(self, n):
        return self.allocator.alloc(-(-n // self.page_size) * self.page_size)[:n]

    def forward(self, make_batch, q, k, v):
        """The batch (``make_batch(runner)``) as the server runs it (token split): each rank writes
        the K/V of its own rows, attends every query (the all-gathered q) over its keys; the
        partials combined: the output of every row (every row runs on exactly one rank)."""
        parts = []
        for runner in self.runners:
            batch, backend = make_batch(runner), runner.attn_backend
            backend.init_forward_metadata(batch)
            rows = backend.local_rows
            backend._save_local_kv(k[rows], v[rows], self.layer, batch)
            parts.append(backend.local_partials(q, None, None, self.layer, batch, save_kv_cache=False))
        assert sorted(torch.cat([r.attn_backend.local_rows for r in self.runners]).tolist()) == list(range(q.shape[0]))
        return combine_partials(torch.stack(parts), HEADS, HEAD_DIM)


@pytest.mark.parametrize("page_size", [1, 4])
def test_partials_combined_equal_dense_and_each_rank_holds_its_pages(page_size):
    ranks = Ranks(page_size)
    g = torch.Generator().manual_seed(page_size)
    n = 38
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    slots = ranks.slots(n)
    for runner in ranks.runners:  # stale bytes of earlier pages in every slot
        runner.token_to_kv_pool.get_key_buffer(0).fill_(7.0)
        runner.token_to_kv_pool.get_value_buffer(0).fill_(7.0)

    def extend(lo, hi):
        return ranks.forward(lambda r: ForwardBatch.init_extend(r, [0], [lo], [[1] * (hi - lo)], slots[lo:hi]),
                             q[lo:hi], k[lo:hi], v[lo:hi])

    extend(0, 20)  # the prefix, cached by an earlier forward
    out = extend(20, 37)
    torch.testing.assert_close(out.double(), dense_reference(q[20:37], k[:37], v[:37], 20), atol=1e-5, rtol=1e-5)
    decode = ranks.forward(lambda r: ForwardBatch.init_decode(r, [0], [1], [38], slots[37:]), q[37:], k[37:], v[37:])
    torch.testing.assert_close(decode.double(), dense_reference(q[37:], k, v, 37), atol=1e-5, rtol=1e-5)

    owners = cp_owner(torch.arange(n), page_size, CP)
    for rank, runner in enumerate(ranks.runners):
        keys = runner.token_to_kv_pool.get_key_buffer(0)[slots]
        mine = owners == rank
        assert torch.equal(keys[mine], k[mine]), "a rank's own pages hold its K"
        assert not keys[~mine].any(), "another rank's pages hold zeros, not stale bytes"


def test_owner_is_page_round_robin():
    assert cp_owner(torch.arange(10), 1, 2).tolist() == [0, 1] * 5  # page 1: upstream's interleave
    assert cp_owner(torch.arange(12), 4, 2).tolist() == [0] * 4 + [1] * 4 + [0] * 4
    assert cp_owner(torch.arange(6), 2, 3).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("flags, message", [
    ({"attn_cp_size": 2, "pp_size": 2}, "--attn-cp-size 2 is not supported with --pp-size 2"),
    ({"attn_cp_size": 2, "disaggregation_mode": "prefill"},
     "--attn-cp-size 2 is not supported with --disaggregation-mode prefill"),
    ({"attn_cp_size": 2, "enable_hierarchical_cache": True, "hicache_size": 1},
     "--hicache-size 1 is not supported with --attn-cp-size 2"),
    ({"attn_cp_size": 0}, "--attn-cp-size 0 is invalid; must be an integer >= 1"),
])
def test_refused_combinations(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="/nonexistent", **flags)
