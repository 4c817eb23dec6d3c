"""Rank mapping and head / state slicing against a brute-force simulation.

For every H in {1, 2, 4, 8} and Tp, Td in {1, 2, 4, 8}: build the descriptors the prefill side
would post (same planner and builders as production), apply them to simulated address spaces
(numpy arrays standing in for each rank's registered memory, buffers separated by guard
bytes), and check that every decode rank holds exactly the heads it owns under contiguous
replication, every destination byte was written exactly once by a prefill rank holding that
head, and nothing outside the destination pages was touched.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_workers import owned_heads_reference
from sglang.srt.disaggregation.base import IncompatiblePeerError
from sglang.srt.disaggregation.common.descriptors import kv_page_descs, kv_token_slice_descs, page_runs, state_descs
from sglang.srt.disaggregation.common.rank_mapping import (
    head_slice,
    owned_heads,
    plan_decode_rank,
    required_dst_info_num,
    state_row_slices,
    state_slice,
    target_prefill_ranks,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

SIZES = (1, 2, 4, 8)
P = 2  # page size
NUM_PAGES = 6  # pages per buffer, page 0 included
GUARD = 16  # bytes between buffers
HEAD_BYTES = (3, 2)  # K and V bytes per head (different, to catch K/V mix-ups)
LAYERS = 2


class Space:
    """One rank's simulated memory: buffers (K layers then V layers) with guards around them."""

    def __init__(self, heads_local: int, fill):
        self.item_lens = [HEAD_BYTES[c] * heads_local for c in (0, 1) for _ in range(LAYERS)]
        self.ptrs, off = [], GUARD
        for item in self.item_lens:
            self.ptrs.append(off)
            off += item * P * NUM_PAGES + GUARD
        self.mem = np.full(off, fill, dtype=np.int64)
        self.writes = np.zeros(off, dtype=np.int64)


def code(buf: int, pos: int, head: int, byte: int) -> int:
    return ((buf * 1000 + pos) * 100 + head) * 10 + byte


def prefill_space(H: int, Tp: int, p: int, src_pages) -> Space:
    heads = owned_heads_reference(H, Tp, p)
    sp = Space(len(heads), fill=-(p + 2))  # bytes of no request: a per-rank marker
    for b, (ptr, item) in enumerate(zip(sp.ptrs, sp.item_lens)):
        hb = HEAD_BYTES[b // LAYERS]
        for pos in range(len(src_pages) * P):
            slot = src_pages[pos // P] * P + pos % P
            for j, h in enumerate(heads):
                for k in range(hb):
                    sp.mem[ptr + slot * item + j * hb + k] = code(b, pos, h, k)
    return sp


def apply(descs, src: Space, dst: Space) -> None:
    for (s, n, _), (d, n2, _) in zip(descs.src.tolist(), descs.dst.tolist()):
        assert n == n2 and n > 0
        dst.mem[d:d + n] = src.mem[s:s + n]
        dst.writes[d:d + n] += 1


def simulate(H: int, Tp: int, Td: int, src_pages, dst_pages, chunks=(1,)) -> None:
    prefill = [prefill_space(H, Tp, p, src_pages) for p in range(Tp)]
    src_arr, dst_arr = np.array(src_pages), np.array(dst_pages)
    for d in range(Td):
        heads = owned_heads_reference(H, Td, d)
        dsp = Space(len(heads), fill=-1)
        for plan in plan_decode_rank(H, Tp, Td, d, is_mla=False, has_state=False):
            if not plan.send_kv:
                continue
            hs = head_slice(H, Tp, plan.prefill_rank, Td, d)
            assert hs is not None, (H, Tp, Td, d, plan)
            sp = prefill[plan.prefill_rank]
            for lo, hi in zip((0, *chunks), (*chunks, len(src_pages))):
                if hs.is_whole_token:
                    descs = kv_page_descs(sp.ptrs, dsp.ptrs, sp.item_lens, P, src_arr[lo:hi], dst_arr[lo:hi])
                else:
                    descs = kv_token_slice_descs(sp.ptrs, sp.item_lens, dsp.ptrs, dsp.item_lens, P, src_arr[lo:hi],
                                                 dst_arr[lo:hi], hs)
                apply(descs, sp, dsp)
        expected = np.full_like(dsp.mem, -1)
        for b, (ptr, item) in enumerate(zip(dsp.ptrs, dsp.item_lens)):
            hb = HEAD_BYTES[b // LAYERS]
            for pos in range(len(dst_pages) * P):
                slot = dst_pages[pos // P] * P + pos % P
                for j, h in enumerate(heads):
                    for k in range(hb):
                        expected[ptr + slot * item + j * hb + k] = code(b, pos, h, k)
        where = f"H={H} Tp={Tp} Td={Td} decode {d}"
        np.testing.assert_array_equal(dsp.mem, expected, err_msg=f"{where}: wrong bytes")
        np.testing.assert_array_equal(dsp.writes, (expected != -1).astype(np.int64),
                                      err_msg=f"{where}: a byte written other than exactly once")


@pytest.mark.parametrize("H,Tp,Td", list(itertools.product(SIZES, SIZES, SIZES)))
def test_every_decode_rank_gets_exactly_its_heads(H, Tp, Td):
    simulate(H, Tp, Td, src_pages=[3, 4, 1], dst_pages=[2, 3, 5], chunks=(2,))


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    H=st.sampled_from(SIZES), Tp=st.sampled_from(SIZES), Td=st.sampled_from(SIZES),
    pages=st.integers(1, NUM_PAGES - 1).flatmap(lambda n: st.tuples(
        st.permutations(range(1, NUM_PAGES)).map(lambda p: p[:n]),
        st.permutations(range(1, NUM_PAGES)).map(lambda p: p[:n]),
        st.integers(0, n),
    )),
)
def test_random_scattered_pages_and_chunks(H, Tp, Td, pages):
    src, dst, cut = pages
    simulate(H, Tp, Td, list(src), list(dst), chunks=(cut,))


@pytest.mark.parametrize("H,T", list(itertools.product(SIZES, SIZES)))
def test_owned_heads_matches_reference(H, T):
    for r in range(T):
        assert list(owned_heads(H, T, r)) == owned_heads_reference(H, T, r)


def test_decode_side_replication_is_contiguous_pitfall_11():
    # H=2, Tp=1, Td=4: decode ranks own heads 0,0,1,1 (round-robin would give 0,1,0,1).
    offsets = [head_slice(2, 1, 0, 4, d).src_head_offset for d in range(4)]
    assert offsets == [0, 0, 1, 1]
    # the worked examples of the docs
    assert head_slice(8, 2, 1, 4, 3) == head_slice(8, 2, 1, 4, 3).__class__(2, 0, 2, 4, 2)
    assert head_slice(8, 4, 2, 2, 1).dst_head_offset == 0
    assert head_slice(8, 4, 3, 2, 1).dst_head_offset == 2


def test_replicated_prefill_ranks_send_once():
    # H=2, Tp=8, Td=2: prefill ranks 0-3 all hold head 0; only rank 0 writes it.
    plans = plan_decode_rank(2, 8, 2, 0, is_mla=False, has_state=True)
    assert [(p.prefill_rank, p.send_kv, p.send_state, p.send_aux) for p in plans] == [
        (0, True, True, True), (1, False, True, False), (2, False, True, False), (3, False, True, False)]


def test_mla_only_first_target_sends():
    plans = plan_decode_rank(1, 4, 2, 1, is_mla=True, has_state=False)
    assert [(p.prefill_rank, p.send_kv, p.send_aux) for p in plans] == [(2, True, True), (3, False, False)]


@pytest.mark.parametrize("Tp,Td", list(itertools.product(SIZES, SIZES)))
def test_every_prefill_rank_gets_required_dst_info_num_requests(Tp, Td):
    for p in range(Tp):
        asking = [d for d in range(Td) if p in target_prefill_ranks(Tp, Td, d)]
        assert len(asking) == required_dst_info_num(Tp, Td)


def test_unmappable_pairings_are_refused_naming_both():
    with pytest.raises(IncompatiblePeerError, match="prefill tp_size 3 and decode tp_size 2"):
        target_prefill_ranks(3, 2, 0)
    with pytest.raises(IncompatiblePeerError, match="decode tp_size 4 .* total_kv_head_num 6"):
        plan_decode_rank(6, 2, 4, 0, is_mla=False, has_state=False)


@pytest.mark.parametrize("Tp,Td", list(itertools.product(SIZES, SIZES)))
def test_state_rows_sliced_by_tp_shard(Tp, Td):
    total_rows, row_bytes, slots = 8, 3, (2, 0)
    src_rows, dst_rows = total_rows // Tp, total_rows // Td
    for d in range(Td):
        dst = np.full(4 * dst_rows * row_bytes, -1, dtype=np.int64)
        writes = np.zeros_like(dst)
        for plan in plan_decode_rank(8, Tp, Td, d, is_mla=False, has_state=True):
            p = plan.prefill_rank
            src = np.full(4 * src_rows * row_bytes, -5, dtype=np.int64)
            src[slots[0] * src_rows * row_bytes:(slots[0] + 1) * src_rows * row_bytes] = np.arange(
                p * src_rows * row_bytes, (p + 1) * src_rows * row_bytes)
            sl = state_slice(src_rows, dst_rows, Tp, p, Td, d)
            descs = state_descs([0], [src_rows * row_bytes], [src_rows], [0], [dst_rows * row_bytes], [dst_rows],
                                np.array([slots[0]]), np.array([slots[1]]), [sl])
            for (s, n, _), (t, _, _) in zip(descs.src.tolist(), descs.dst.tolist()):
                dst[t:t + n] = src[s:s + n]
                writes[t:t + n] += 1
        want = np.full_like(dst, -1)
        want[:dst_rows * row_bytes] = np.arange(d * dst_rows * row_bytes, (d + 1) * dst_rows * row_bytes)
        np.testing.assert_array_equal(dst, want)
        np.testing.assert_array_equal(writes, (want != -1).astype(np.int64))


@pytest.mark.parametrize("Tp,Td", list(itertools.product((1, 2, 4), (1, 2, 4))))
def test_segmented_state_rows_join_and_cut_per_segment(Tp, Td):
    """A conv state of q | k | v segments (8, 8, 16 global rows), each sharded across TP on its
    own: every decode rank ends up with its slice of each segment, each row written once."""
    segments = (8, 8, 16)
    global_rows = np.arange(sum(segments))
    starts = np.cumsum((0,) + segments[:-1])

    def rank_rows(tp, r):  # the global rows a rank holds, in its own order
        return np.concatenate([st + np.arange(r * n // tp, (r + 1) * n // tp) for st, n in zip(starts, segments)])

    for d in range(Td):
        got = np.full(sum(segments) // Td, -1)
        for plan in plan_decode_rank(8, Tp, Td, d, is_mla=False, has_state=True):
            held = global_rows[rank_rows(Tp, plan.prefill_rank)]
            runs = state_row_slices([n // Tp for n in segments], [n // Td for n in segments], Tp, plan.prefill_rank,
                                    Td, d)
            for run in runs:
                assert (got[run.dst_row_offset:run.dst_row_offset + run.num_rows] == -1).all()
                got[run.dst_row_offset:run.dst_row_offset + run.num_rows] = held[
                    run.src_row_offset:run.src_row_offset + run.num_rows]
        np.testing.assert_array_equal(got, rank_rows(Td, d))
    with pytest.raises(IncompatiblePeerError, match="state segments"):
        state_row_slices([4, 4], [8], 2, 0, 1, 0)


def test_page_runs_merge_pages_consecutive_on_both_sides():
    s, d, n = page_runs(np.array([3, 4, 5, 9, 1]), np.array([7, 8, 2, 3, 4]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3, 5, 9, 1], [7, 2, 3, 4], [2, 1, 1, 1])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
