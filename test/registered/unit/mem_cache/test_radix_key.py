"""RadixKey as one int64 array: conversion, views, bulk comparison, page bytes, the vectorised
page hash chain, and a property test of the array-backed tree match against a naive reference."""

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_fixtures import make_radix

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix.page_hash import hash_page, namespace_hash, page_hashes
from sglang.srt.mem_cache.radix.radix_key import RadixKey, as_token_array, common_prefix_len
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def test_key_from_list_array_and_tensor_is_one_readonly_int64_array():
    for source in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7], dtype=np.int32), torch.tensor([5, 6, 7])):
        key = RadixKey(source, "tenant")
        assert key.ids.dtype == np.int64 and key.ids.tolist() == [5, 6, 7]
        assert key.token_ids == [5, 6, 7] and len(key) == 3 and key.extra_key == "tenant"
        with pytest.raises(ValueError):
            key.ids[0] = 1  # read-only
    buf = np.arange(10, dtype=np.int64)
    key = RadixKey(buf)
    assert np.shares_memory(key.ids, buf)  # no copy for an int64 array
    kept = key.copy()
    assert not np.shares_memory(kept.ids, buf) and kept == key


def test_slices_are_views_with_the_namespace():
    key = RadixKey(list(range(20)), "ns")
    part = key[4:12]
    assert part.token_ids == list(range(4, 12)) and part.extra_key == "ns"
    assert np.shares_memory(part.ids, key.ids)
    # upstream's indexing: key[i] is the one-token key at i, in the same namespace
    assert key[3].token_ids == [3] and key[-1].token_ids == [19] and key[-1].extra_key == "ns"
    assert list(key[:3]) == [0, 1, 2] and all(type(t) is int for t in key[:3])
    with pytest.raises(IndexError):
        key[20]
    with pytest.raises(IndexError):
        key[-21]
    with pytest.raises(TypeError):
        key["3"]
    with pytest.raises(ValueError, match="step 1"):
        key[::2]


def test_bad_keys_are_refused():
    with pytest.raises(TypeError):
        RadixKey([1, 2], extra_key=3)
    with pytest.raises(TypeError):
        RadixKey([1.5, 2.0])
    with pytest.raises(TypeError):
        RadixKey(["a"])
    with pytest.raises(ValueError):
        RadixKey(np.zeros((2, 2), dtype=np.int64))
    assert as_token_array([]).shape == (0,)


def test_equality_hash_and_child_key():
    a, b = RadixKey([1, 2, 3, 4]), RadixKey(np.array([1, 2, 3, 4]))
    assert a == b and hash(a) == hash(b) and a != RadixKey([1, 2, 3, 4], "x")
    assert a.child_key(2, 2) == (None, np.array([3, 4], dtype=np.int64).tobytes())
    assert a.page(1, 2) == (3, 4)


def test_common_prefix_len_rounds_down_to_pages():
    a = np.arange(16)
    b = a.copy()
    assert common_prefix_len(a, b, 4) == 16
    b[9] = -1
    assert common_prefix_len(a, b, 4) == 8  # the mismatch is in page 2
    assert common_prefix_len(a, b, 1) == 9
    assert common_prefix_len(a[:7], b, 4) == 4  # whole pages of the shorter only
    b[0] = -1
    assert common_prefix_len(a, b, 4) == 0


def _reference_hash(prior: str, tokens) -> str:
    h = hashlib.sha256(bytes.fromhex(prior))
    for t in tokens:
        h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


def test_page_hashes_equal_the_per_token_definition():
    seed = namespace_hash("tenant")
    tokens = [0, 1, 2**32 - 1, 77, 5, 6, 7, 8, 9]  # a trailing partial page is ignored
    hashes = page_hashes(np.array(tokens), 4, seed)
    assert hashes == page_hashes(tokens, 4, seed) and len(hashes) == 2
    assert hashes[0] == _reference_hash(seed, tokens[:4]) == hash_page(seed, tokens[:4])
    assert hashes[1] == _reference_hash(hashes[0], tokens[4:8])
    with pytest.raises(ValueError, match="token id -1"):
        page_hashes([1, -1], 2, seed)
    with pytest.raises(ValueError, match="token id 4294967296"):
        hash_page(seed, [2**32])


def naive_match_len(inserted: list[list[int]], query: list[int], page_size: int) -> int:
    """The longest whole-page prefix of ``query`` that some inserted sequence starts with."""
    best = 0
    limit = len(query) // page_size * page_size
    for seq in inserted:
        n = 0
        while n + page_size <= min(limit, len(seq)) and seq[n : n + page_size] == query[n : n + page_size]:
            n += page_size
        best = max(best, n)
    return best


tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=24)


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), seqs=st.lists(tokens_st, min_size=1, max_size=6),
       queries=st.lists(tokens_st, min_size=1, max_size=6))
def test_tree_match_equals_a_naive_reference(page_size, seqs, queries):
    """Insert sequences (whole pages), then every query matches exactly the naive longest
    cached page prefix, with the slots the inserting sequence gave those tokens."""
    tree = make_radix(page_size=page_size, device_pages=200)
    alloc = tree.token_to_kv_pool_allocator
    inserted, owner = [], {}
    for seq in seqs:
        seq = seq[: len(seq) // page_size * page_size]
        if not seq:
            continue
        slots = alloc.alloc(len(seq))
        dup = tree.insert(InsertParams(key=RadixKey(seq), value=slots)).prefix_len
        alloc.free(slots[:dup])
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(seq)))
        assert m.device_indices.numel() == len(seq)
        for i in range(len(seq)):  # a slot belongs to the whole page prefix ending its page
            owner.setdefault((tuple(seq[: (i // page_size + 1) * page_size]), i), int(m.device_indices[i]))
        inserted.append(seq)
    tree.check_integrity()
    for q in queries + seqs:
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(q)))
        n = naive_match_len(inserted, q, page_size)
        assert m.device_indices.numel() == n
        want = [owner[(tuple(q[: (i // page_size + 1) * page_size]), i)] for i in range(n)]
        assert m.device_indices.tolist() == want
        assert sum(len(node.key) for node in m.path) == n
    tree.check_integrity()
