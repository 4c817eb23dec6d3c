"""PagedAllocator / PagedTokenToKVPoolAllocator: exact slot ids, refusals and errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.allocator import PagedAllocator, PagedTokenToKVPoolAllocator
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def test_device_allocator_reserves_page_zero():
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    assert alloc.available_size() == 16
    assert alloc.alloc(8).tolist() == list(range(4, 12))
    assert alloc.alloc(8).tolist() == list(range(12, 20))
    assert alloc.alloc(4) is None
    with pytest.raises(ValueError, match="out of range"):
        alloc.free(torch.arange(0, 4))  # the reserved padding page


def test_freed_pages_are_reused_lowest_first():
    alloc = PagedAllocator(6, 2)
    slots = alloc.alloc(12)
    alloc.free(slots[8:10])  # page 4
    alloc.free(slots[2:4])  # page 1
    assert alloc.alloc(4).tolist() == [2, 3, 8, 9]


def test_errors_leave_state_unchanged():
    alloc = PagedAllocator(4, 2)
    slots = alloc.alloc(8)
    alloc.free(slots[:2])
    with pytest.raises(ValueError, match="double free: page 0"):
        alloc.free(torch.tensor([2, 3, 0, 1]))  # page 1 is valid, page 0 already free
    assert alloc.available_size() == 2  # page 1 was not freed either
    with pytest.raises(ValueError, match="same page twice"):
        alloc.free(torch.tensor([2, 3, 2, 3]))
    with pytest.raises(ValueError, match="non-negative multiple of page_size 2"):
        alloc.alloc(3)
    with pytest.raises(ValueError, match="size 10 is not a multiple of page_size 4"):
        PagedTokenToKVPoolAllocator(10, 4)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=40), st.sampled_from([1, 2, 4]))
def test_accounting_matches_a_model(ops, page_size):
    alloc = PagedAllocator(16, page_size)
    held: list[torch.Tensor] = []
    for do_alloc, n in ops:
        if do_alloc:
            got = alloc.alloc(n * page_size)
            free_pages = alloc.available_size() // page_size + (0 if got is None else n)
            assert (got is None) == (n > free_pages)
            if got is not None:
                held.append(got)
        elif held:
            alloc.free(held.pop(n % len(held)))
        in_use = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert in_use.unique().numel() == in_use.numel()
        assert alloc.available_size() == 16 * page_size - in_use.numel()
        assert not alloc.is_free(in_use).any()
