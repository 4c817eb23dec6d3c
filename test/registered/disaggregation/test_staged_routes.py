"""Staged KV routes against a brute-force reference, for every H, Tp, Td in {1, 2, 4, 8}.

The production pieces (head slices, SliceLayout, SliceCopier, staged_run_descs,
into_staging_descs) are composed as the manager composes them, on real memory: prefill pools
hold a code per (buffer, token position, GLOBAL head, word); descriptors are applied with
memmove (standing in for the NIXL WRITE) after checking that each lies inside its source and
inside the decode's staging area; decode scatters every piece as it lands. Each decode rank
must end with exactly the heads it owns at its destination pages and nothing else touched, both
when prefill packs pieces locally (route ``packed``) and when it writes straight into the
decode's staging (``decode_staging``, or per token when its tokens are cut).
"""

import ctypes
import itertools

import numpy as np
import pytest
import torch

from pd_workers import owned_heads_reference
from sglang.srt.disaggregation.common.descriptors import into_staging_descs, staged_run_descs
from sglang.srt.disaggregation.common.rank_mapping import head_slice, plan_decode_rank
from sglang.srt.disaggregation.common.staging import PoolBuffers, SliceCopier, SliceLayout
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

SIZES = (1, 2, 4, 8)
P, NUM_PAGES, LAYERS = 2, 6, 2
HEAD_WORDS = (1, 2)  # int64 words per head of K and of V (different, to catch K/V mix-ups)
SRC_PAGES, DST_PAGES, STEP = [3, 4, 1], [2, 3, 5], 2  # pieces of 2 pages: [0, 2) then [2, 3)


def code(buf: int, pos: int, head: int, word: int) -> int:
    return ((buf * 1000 + pos) * 100 + head) * 10 + word


class Rank:
    """One rank's KV buffers (K layers then V layers) as int64 tensors, filled with ``fill``."""

    def __init__(self, heads: list[int], fill: int):
        self.heads = heads
        self.words = [HEAD_WORDS[c] * len(heads) for c in (0, 1) for _ in range(LAYERS)]
        self.tensors = [torch.full((NUM_PAGES * P * w,), fill, dtype=torch.int64) for w in self.words]
        self.pool = PoolBuffers([t.data_ptr() for t in self.tensors], [t.numel() * 8 for t in self.tensors],
                                [w * 8 for w in self.words])

    def write_codes(self, pages: list[int]) -> None:
        for b, (t, w) in enumerate(zip(self.tensors, self.words)):
            hw = HEAD_WORDS[b // LAYERS]
            for pos in range(len(pages) * P):
                slot = pages[pos // P] * P + pos % P
                for j, h in enumerate(self.heads):
                    for k in range(hw):
                        t[slot * w + j * hw + k] = code(b, pos, h, k)


def apply(descs, src_ranges, dst_range) -> None:
    """memmove every descriptor after checking it stays inside a source range and the destination."""
    for (s, n, _), (d, n2, _) in zip(descs.src.tolist(), descs.dst.tolist()):
        assert n == n2 and n > 0
        assert any(lo <= s and s + n <= hi for lo, hi in src_ranges), "descriptor reads outside its source"
        assert dst_range[0] <= d and d + n <= dst_range[1], "descriptor writes outside the decode's staging"
        ctypes.memmove(d, s, n)


def send_staged(prefill: Rank, decode: Rank, hs, packed: bool) -> None:
    """One target's KV through the decode's staging, piece by piece, as kv_routes does it."""
    whole = hs.is_whole_token
    src_layout = SliceLayout.of_heads(prefill.pool.item_lens, hs.src_heads, hs.src_head_offset, hs.num_heads)
    dst_layout = SliceLayout.of_heads(decode.pool.item_lens, hs.dst_heads, hs.dst_head_offset, hs.num_heads)
    assert src_layout.widths == dst_layout.widths
    total = len(DST_PAGES) * P
    staging = torch.full((dst_layout.nbytes(total),), 0x5A, dtype=torch.uint8)
    dst_range = (staging.data_ptr(), staging.data_ptr() + staging.numel())
    pool_ranges = [(p, p + n) for p, n in zip(prefill.pool.ptrs, prefill.pool.lens)]
    src, dst = np.array(SRC_PAGES), np.array(DST_PAGES)
    for lo in range(0, len(SRC_PAGES), STEP):
        pages, tokens = src[lo:lo + STEP], min(STEP, len(SRC_PAGES) - lo) * P
        if packed:
            local = torch.empty(src_layout.nbytes(tokens), dtype=torch.uint8)
            SliceCopier(prefill.pool, src_layout, P).gather(pages, local, tokens)
            descs = staged_run_descs(src_layout.widths, local.data_ptr(), tokens, 0, staging.data_ptr(), total,
                                     lo * P, tokens)
            apply(descs, [(local.data_ptr(), local.data_ptr() + local.numel())], dst_range)
        else:
            descs = into_staging_descs(prefill.pool.ptrs, prefill.pool.item_lens, P, pages, None if whole else hs,
                                       staging.data_ptr(), total, lo, src_layout.widths)
            apply(descs, pool_ranges, dst_range)
        SliceCopier(decode.pool, dst_layout, P).scatter(dst[lo:lo + STEP], staging, total, lo * P)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "direct"])
@pytest.mark.parametrize("H,Tp,Td", list(itertools.product(SIZES, SIZES, SIZES)))
def test_staged_routes_deliver_exactly_the_owned_heads(H, Tp, Td, packed):
    prefill = []
    for p in range(Tp):
        rank = Rank(owned_heads_reference(H, Tp, p), fill=-(p + 2))
        rank.write_codes(SRC_PAGES)
        prefill.append(rank)
    for d in range(Td):
        decode = Rank(owned_heads_reference(H, Td, d), fill=-1)
        for plan in plan_decode_rank(H, Tp, Td, d, is_mla=False, has_state=False):
            if plan.send_kv:
                send_staged(prefill[plan.prefill_rank], decode, head_slice(H, Tp, plan.prefill_rank, Td, d), packed)
        want = Rank(decode.heads, fill=-1)
        want.write_codes(DST_PAGES)
        for b, (got, exp) in enumerate(zip(decode.tensors, want.tensors)):
            np.testing.assert_array_equal(got.numpy(), exp.numpy(), err_msg=f"H={H} Tp={Tp} Td={Td} decode {d} buf {b}")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
