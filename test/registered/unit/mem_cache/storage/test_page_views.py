"""PageViews: the storage layer's numpy views of host pages equal get_data_page, byte for byte
and address for address, for every pool kind and layout; page_starts validates like utils."""

import numpy as np
import pytest
import torch
from conftest import fill_random, host_pool

from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.page_views import PageViews
from sglang.srt.mem_cache.storage.pool_codec import page_starts
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

CELLS = [
    (PoolKind.MHA, "layer_first"),
    (PoolKind.MHA, "page_first"),
    (PoolKind.MHA, "page_first_direct"),
    (PoolKind.MHA, "page_head"),
    (PoolKind.MLA, "layer_first"),
    (PoolKind.MLA, "page_first_direct"),
    (PoolKind.DSA_INDEXER, "layer_first"),
    (PoolKind.DSV4_STATE, "page_first_direct"),
    (PoolKind.MAMBA, "layer_first"),
    (PoolKind.MAMBA, "page_first_direct"),
    (PoolKind.DSV4_ANCHOR, "page_first_direct"),
]


def assert_same_chunks(host, views: PageViews) -> None:
    for page in range(host.page_num):
        expected = host.get_data_page(page * host.page_size, flat=False)
        got, ptrs = views.chunks(page)
        assert ptrs == [t.data_ptr() for t in expected]
        assert [bytes(v) for v in got] == [t.numpy().tobytes() for t in expected]


@pytest.mark.parametrize("kind,layout", CELLS, ids=lambda v: getattr(v, "value", v))
def test_views_equal_get_data_page(kind, layout):
    host = host_pool(kind, layout)
    fill_random(host, seed=21)
    views = PageViews(host)
    assert views._chunks is not None  # every layout is affine: the fast path is taken
    assert_same_chunks(host, views)
    if host.page_num and views._chunks:
        views.chunks(1)[0][0][:] = 0xAB  # the views alias host memory
        assert int(host.get_data_page(host.page_size, flat=False)[0][0]) == 0xAB


def test_non_affine_pool_falls_back_to_get_data_page(monkeypatch):
    host = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(host, seed=22)
    real = host.get_page_buffer_meta
    last = torch.arange((host.page_num - 1) * host.page_size, host.page_num * host.page_size)

    def shifted(indices):  # the last page is not where pages 0 and 1 predict
        ptrs, sizes = real(indices)
        return ([p + 64 for p in ptrs], sizes) if torch.equal(indices, last) else (ptrs, sizes)

    monkeypatch.setattr(host, "get_page_buffer_meta", shifted)
    views = PageViews(host)
    assert views._chunks is None
    assert_same_chunks(host, views)


@pytest.mark.parametrize(
    "idx,match",
    [
        ([1, 2, 3, 4], "page starts at slot 1, not a multiple of page_size 4"),
        ([0, 1, 2, 4], "a page is not 4 consecutive slots"),
        ([32, 33, 34, 35], r"out of range: min 32, max 35, allowed \[0, 32\)"),
        ([-4, -3, -2, -1], "out of range: min -4"),
        ([0, 1, 2], "length 3 is not a multiple of page_size 4"),
    ],
)
def test_page_starts_rejects_what_utils_rejects(idx, match):
    with pytest.raises(ValueError, match=match):
        page_starts(np.array(idx, dtype=np.int64), 4, 32)


def test_page_starts_any_page_order():
    assert page_starts(np.array([8, 9, 10, 11, 0, 1, 2, 3]), 4, 32) == [8, 0]
    assert page_starts(np.array([5, 3]), 1, 8) == [5, 3]
    assert page_starts(np.array([], dtype=np.int64), 4, 32) == []
