"""Staging copies (SliceCopier.gather / scatter) against a brute-force byte reference.

Pools are real tensors addressed by pointer, as in production. For whole tokens (the page fast
path), head slices at every offset, widths that force 1-, 2-, 4- and 8-byte words, scattered
pages and a staged area holding more tokens than the pages copied: the gathered area must equal
the reference byte for byte, a scatter must write exactly the slice bytes of exactly the given
pages, and gather-then-scatter into a second pool must reproduce the slices.
"""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.base import TransferConfig
from sglang.srt.disaggregation.common import staging
from sglang.srt.disaggregation.common.staging import PoolBuffers, SliceCopier, SliceLayout
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

NUM_PAGES = 6
PATHS = [False, True] if staging._native is not None else [False]  # NATIVE_COPY values to run


@contextlib.contextmanager
def copy_path(native: bool):
    saved, staging.NATIVE_COPY = staging.NATIVE_COPY, native
    try:
        yield
    finally:
        staging.NATIVE_COPY = saved


def make_pool(item_lens, page_size: int, seed: int, guard: int = 8):
    """One uint8 tensor per buffer (plus guard bytes after it), random contents."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (item * page_size * NUM_PAGES + guard,), dtype=torch.uint8, generator=g)
               for item in item_lens]
    pool = PoolBuffers([t.data_ptr() for t in tensors], [t.numel() - guard for t in tensors], list(item_lens))
    return tensors, pool


def reference_area(tensors, layout: SliceLayout, item_lens, page_size: int, pages, area_tokens: int,
                   first_token: int, fill: int) -> np.ndarray:
    """The staged area a gather of ``pages`` must produce, built one byte range at a time."""
    area = np.full(layout.nbytes(area_tokens), fill, dtype=np.uint8)
    for b, (t, item) in enumerate(zip(tensors, item_lens)):
        off, width = layout.offsets[b], layout.widths[b]
        base = area_tokens * sum(layout.widths[:b])
        mem = t.numpy()
        for i, page in enumerate(pages):
            for k in range(page_size):
                src = (page * page_size + k) * item + off
                dst = base + (first_token + i * page_size + k) * width
                area[dst:dst + width] = mem[src:src + width]
    return area


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_bytes = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    item_lens = [heads * head_bytes * m for m in draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3))]
    num_heads = draw(st.integers(1, heads))
    head_offset = draw(st.integers(0, heads - num_heads))
    page_size = draw(st.sampled_from([1, 2, 4]))
    pages = draw(st.permutations(range(NUM_PAGES)).map(list))[:draw(st.integers(0, NUM_PAGES))]
    first_page = draw(st.integers(0, 3))
    return item_lens, heads, head_offset, num_heads, page_size, pages, first_page


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(cases())
def test_gather_then_scatter_matches_brute_force(case):
    for native in PATHS:
        with copy_path(native):
            check_gather_then_scatter(case)


def check_gather_then_scatter(case):
    item_lens, heads, head_offset, num_heads, page_size, pages, first_page = case
    layout = SliceLayout.of_heads(item_lens, heads, head_offset, num_heads)
    tensors, pool = make_pool(item_lens, page_size, seed=len(pages) * 31 + head_offset)
    area_tokens = (first_page + len(pages) + 1) * page_size  # room before and after the copied tokens
    area = torch.full((layout.nbytes(area_tokens) + 8,), 0xAB, dtype=torch.uint8)
    first_token, page_ids = first_page * page_size, np.array(pages, dtype=np.int64)

    SliceCopier(pool, layout, page_size).gather(page_ids, area, area_tokens, first_token)
    want = reference_area(tensors, layout, item_lens, page_size, pages, area_tokens, first_token, fill=0xAB)
    np.testing.assert_array_equal(area.numpy()[:-8], want)
    assert bool((area[-8:] == 0xAB).all()), "gather wrote past the area"

    # scatter the area into a second pool at other pages: exactly the slice bytes of those pages change
    dst_tensors, dst_pool = make_pool(item_lens, page_size, seed=99)
    before = [t.clone() for t in dst_tensors]
    dst_pages = [(p + 1) % NUM_PAGES for p in pages]
    copier = SliceCopier(dst_pool, layout, page_size)
    copier.scatter(np.array(dst_pages[:1], dtype=np.int64), area, area_tokens, first_token)  # views built, then reused
    copier.scatter(np.array(dst_pages, dtype=np.int64), area, area_tokens, first_token)
    expected = [t.numpy().copy() for t in before]
    for b, item in enumerate(item_lens):
        off, width = layout.offsets[b], layout.widths[b]
        src = area.numpy()[area_tokens * sum(layout.widths[:b]):]
        for i, page in enumerate(dst_pages):
            for k in range(page_size):
                at = (page * page_size + k) * item + off
                pos = (first_token + i * page_size + k) * width
                expected[b][at:at + width] = src[pos:pos + width]
    for b, t in enumerate(dst_tensors):
        np.testing.assert_array_equal(t.numpy(), expected[b], err_msg=f"buffer {b}")
    round_trip = reference_area(dst_tensors, layout, item_lens, page_size, dst_pages, area_tokens, first_token, 0xAB)
    np.testing.assert_array_equal(round_trip, want)


def test_slice_layout_of_heads():
    layout = SliceLayout.of_heads([64, 32], heads_per_token=8, head_offset=2, num_heads=4)
    assert layout == SliceLayout((16, 8), (32, 16))
    assert layout.nbytes(10) == 480


def test_empty_page_list_copies_nothing():
    tensors, pool = make_pool([8], 2, seed=1)
    before = tensors[0].clone()
    copier = SliceCopier(pool, SliceLayout((0,), (8,)), 2)
    copier.gather(np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.uint8), 0)
    copier.scatter(np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.uint8), 0)
    assert torch.equal(tensors[0], before)


@pytest.mark.parametrize("native", PATHS)
def test_copies_refuse_an_area_too_small_and_copy_nothing(native):
    tensors, pool = make_pool([16, 32], 2, seed=3)
    copier = SliceCopier(pool, SliceLayout.of_heads([16, 32], 4, 1, 2), 2)
    pages = np.array([4, 1], dtype=np.int64)
    short = torch.full((copier.layout.nbytes(4) - 1,), 0xCD, dtype=torch.uint8)
    before = [t.clone() for t in tensors]
    with copy_path(native):
        with pytest.raises(ValueError, match="cannot hold tokens"):
            copier.gather(pages, short, 4)
        with pytest.raises(ValueError, match="cannot hold tokens"):
            copier.scatter(pages, short, 4)
        with pytest.raises(ValueError, match=r"cannot hold tokens \[2, 6\) of 4"):
            copier.gather(pages, torch.zeros(copier.layout.nbytes(4), dtype=torch.uint8), 4, first_token=2)
        with pytest.raises(ValueError, match="contiguous CPU uint8"):
            copier.gather(pages, torch.zeros(copier.layout.nbytes(4) // 2, dtype=torch.int16), 4)
    assert bool((short == 0xCD).all()), "a refused gather wrote into the area"
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)), "a refused scatter wrote into the pool"


@pytest.mark.parametrize("field,value", [("staging_bytes", -1), ("descriptor_cost_bytes", -1),
                                         ("descriptor_cost_bytes", 1.5), ("pack_chunk_bytes", 0)])
def test_transfer_config_refuses_bad_sizes(field, value):
    with pytest.raises(ValueError, match=f"TransferConfig.{field} must be"):
        TransferConfig(**{field: value})


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
