"""The tree's upstream surface: one parameter record in, one result record out
(``MatchPrefixParams`` / ``InsertParams`` / ``EvictParams``), ``RadixCache.create_simulated``,
``RadixKey`` indexing and iteration, ``TreeNode(id=)`` and its counter, ``pretty_print``,
``all_values_flatten``, ``mem_cache.common`` and ``allocator.TokenToKVPoolAllocator``."""

import unittest.mock

import pytest
import torch
from tree_fixtures import make_radix

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.common import available_and_evictable_str
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix.page_hash import hash_page, namespace_hash
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def test_records_in_and_out_with_exact_slots():
    c = make_radix(page_size=2, device_pages=8)
    assert isinstance(c, BasePrefixCache)
    alloc = c.token_to_kv_pool_allocator
    first = alloc.alloc(4)
    assert first.tolist() == [2, 3, 4, 5]
    got = c.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=first))
    assert got == InsertResult(prefix_len=0)
    dup = alloc.alloc(4)
    assert c.insert(InsertParams(key=RadixKey([1, 2, 7, 8]), value=dup)).prefix_len == 2
    alloc.free(dup[:2])
    m = c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 7, 8, 9])))
    assert isinstance(m, MatchResult)
    assert m.device_indices.tolist() == [2, 3, 8, 9] and m.prefix_len == 4
    assert c.evict(EvictParams(num_tokens=1)) == EvictResult(num_tokens_evicted=2, mamba_num_evicted=0)
    assert sorted(c.all_values_flatten().tolist()) == [2, 3, 8, 9]  # [3, 4] was the older leaf
    c.check_integrity()


def test_params_refuse_what_no_tree_reads():
    with pytest.raises(TypeError):
        InsertParams(key=RadixKey([1]), value=torch.tensor([1]), swa_evicted_seqlen=3)  # upstream-only field
    with pytest.raises(ValueError, match="num_tokens=-1"):
        EvictParams(num_tokens=-1)
    with pytest.raises(ValueError, match="mamba_num=-2"):
        EvictParams(mamba_num=-2)


def test_simulated_tree_takes_opaque_values_and_token_ids_for_none():
    c = RadixCache.create_simulated(page_size=4)
    assert c.device == torch.device("cpu") and c.kv_events is None and c.take_events() == []
    # value None: the token ids stand in; slots need not be whole pages in a simulated tree
    assert c.insert(InsertParams(key=RadixKey([5, 6, 7, 8, 9, 10]), value=None)).prefix_len == 0
    assert c.total_size() == 4  # the partial page [9, 10] is not inserted
    assert c.match_prefix(MatchPrefixParams(key=RadixKey([5, 6, 7, 8]))).device_indices.tolist() == [5, 6, 7, 8]
    assert c.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4  # freed to nowhere
    c.check_integrity()
    with pytest.raises(ValueError, match="3 slots for a key of 4"):
        c.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=torch.tensor([1, 2, 3])))


def test_simulated_tree_frees_to_the_mock_allocator_and_reports_through_common():
    mock = unittest.mock.Mock()
    mock.available_size.return_value = 10
    c = RadixCache.create_simulated(mock_allocator=mock)
    c.insert(InsertParams(key=RadixKey([1, 2]), value=torch.tensor([10, 20])))
    line = "Available tokens: 12 (available=10 + evictable=2)\n"
    assert c.available_and_evictable_str() == line and available_and_evictable_str(c) == line
    c.evict(EvictParams(num_tokens=2))
    freed = mock.free.call_args.args[0]
    assert freed.tolist() == [10, 20]


def test_real_tree_needs_slots_and_a_disabled_tree_takes_nothing():
    c = make_radix(page_size=1, device_pages=4)
    with pytest.raises(TypeError, match="value"):
        c.insert(InsertParams(key=RadixKey([1])))
    disabled = RadixCache.create_simulated(disable=True)
    assert disabled.insert(InsertParams(key=RadixKey([1, 2]), value=None)).prefix_len == 0
    assert disabled.total_size() == 0
    assert disabled.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 0


def test_radix_key_indexes_iterates_and_hashes_by_namespace():
    key = RadixKey([10, 20, 30], "ns")
    assert key.token_ids == [10, 20, 30] and list(key) == [10, 20, 30]
    assert key[0].token_ids == [10] and key[-1].token_ids == [30] and key[1].extra_key == "ns"
    with pytest.raises(IndexError):
        key[3]
    assert key.hash_page(0, 3) == hash_page(namespace_hash("ns"), [10, 20, 30])
    assert key.hash_page(1, 3, prior_hash="00" * 32) == hash_page("00" * 32, [20, 30])
    # "" is a namespace of its own (the tree files it apart from None); None keeps its old seed
    assert namespace_hash("") != namespace_hash(None)
    assert RadixKey([1, 2], "").hash_page(0, 2) != RadixKey([1, 2]).hash_page(0, 2)
    with pytest.raises(IndexError):
        key.hash_page(2, 4)


def test_tree_node_ids_come_from_the_resettable_counter():
    saved = TreeNode.counter
    try:
        TreeNode.counter = 100
        a, b, c = TreeNode(), TreeNode(id=7), TreeNode()
        assert (a.id, b.id, c.id) == (100, 7, 102)  # an explicit id still advances the counter
        assert a.key is None and a.hash_value is None and a.parent is None and a.children == {}
        a.protect_host()
        a.release_host()
        with pytest.raises(RuntimeError, match="not protected"):
            a.release_host()
    finally:
        TreeNode.counter = max(saved, TreeNode.counter)


def test_pretty_print_shows_each_node_by_depth(capsys):
    c = make_radix(page_size=1, device_pages=8)
    alloc = c.token_to_kv_pool_allocator
    c.insert(InsertParams(key=RadixKey([1, 2, 3]), value=alloc.alloc(3)))
    dup = alloc.alloc(3)
    c.insert(InsertParams(key=RadixKey([1, 2, 9]), value=dup))
    alloc.free(dup[:2])
    assert c.pretty_print() is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("RadixKey(len=2, ids=[1, 2]") and "[D]" in lines[0]
    assert sorted(line.split(",")[1] for line in lines[1:3]) == [" ids=[3]", " ids=[9]"]
    assert all(line.startswith("  RadixKey") for line in lines[1:3])
    assert lines[3] == "#tokens on device: 4"


def test_token_to_kv_pool_allocator_is_the_one_token_page_allocator():
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 2, 1, "cpu")
    alloc = TokenToKVPoolAllocator(size=8, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
    assert isinstance(alloc, PagedTokenToKVPoolAllocator) and alloc.page_size == 1
    assert alloc.get_kvcache() is pool and alloc.dtype == torch.float32 and alloc.device == torch.device("cpu")
    assert alloc.alloc(3).tolist() == [1, 2, 3]  # slot 0 is the padding page
    paged = PagedTokenToKVPoolAllocator(8, 2, kvcache=pool)
    assert paged.dtype == torch.float32 and paged.device == torch.device("cpu")
    with pytest.raises(TypeError, match="kvcache="):
        PagedTokenToKVPoolAllocator(8, 2, pool)  # the pool passed where upstream has dtype
