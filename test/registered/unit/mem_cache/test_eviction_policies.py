"""Upstream's eviction policies beside lru / lfu: slru (probationary prefixes before protected
ones, LRU within each), priority (lower request priority first, the highest priority inserted
through a node kept by it and by both halves of a split), tlru refused with the reason; their
parameters (``--radix-eviction-policy-config``) validated, naming the key and the policy."""

from types import SimpleNamespace

import pytest
import torch
from tree_fixtures import make_hicache, make_params, make_radix

from sglang.srt.managers.generate_request import BadRequestError, GenerateReqInput
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import parse_args
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def K(*ids):
    return RadixKey(list(ids))


def cached(c, *ids) -> bool:
    return c.match_prefix(MatchPrefixParams(key=K(*ids))).device_indices.numel() == len(ids)


def radix(policy, config=None, pages=16):
    return RadixCache(make_params(page_size=1, device_pages=pages, eviction_policy=policy,
                                  eviction_policy_config=config))


def put(c, ids, priority=0):
    c.insert(InsertParams(key=K(*ids), value=c.token_to_kv_pool_allocator.alloc(len(ids)), priority=priority))


def survivors_after_one_eviction(c, *prefixes):
    c.evict(EvictParams(num_tokens=1))
    c.check_integrity()
    return [p for p in prefixes if cached(c, *p)]


# ---- slru ---------------------------------------------------------------------------------------
A, B, C = (1, 2), (3, 4), (5, 6)


def slru_workload(c):
    """C: inserted and matched 4 times, long ago. A: inserted and matched once. B: inserted once,
    most recently."""
    put(c, C)
    for _ in range(4):
        c.match_prefix(MatchPrefixParams(key=K(*C)))
    put(c, A)
    c.match_prefix(MatchPrefixParams(key=K(*A)))
    put(c, B)


@pytest.mark.parametrize("policy, config, first_victim", [
    ("lru", None, C),  # the oldest
    ("lfu", None, B),  # the least matched
    ("slru", None, B),  # the only probationary one (fewer than 2 accesses)
    ("slru", {"protected_threshold": 3}, A),  # A is probationary too now, and older than B
    ("slru", {"protected_threshold": 10}, C),  # everything is probationary: plain LRU
])
def test_slru_evicts_probationary_prefixes_before_protected_ones(policy, config, first_victim):
    c = radix(policy, config)
    slru_workload(c)
    left = survivors_after_one_eviction(c, A, B, C)
    assert first_victim not in left and len(left) == 2


def test_slru_orders_protected_prefixes_by_recency_not_count():
    c = radix("slru")
    slru_workload(c)
    c.evict(EvictParams(num_tokens=3))  # B (probationary), then C (protected, older than A)
    assert cached(c, *A) and not cached(c, *C) and not cached(c, *B)


# ---- priority -----------------------------------------------------------------------------------
def test_priority_evicts_lower_priority_first_then_lru():
    for policy, victim in (("lru", (1, 2)), ("priority", (3, 4))):
        c = radix(policy)
        put(c, (1, 2), priority=5)  # the oldest, but important
        put(c, (3, 4), priority=1)  # the lowest priority, and older than (5, 6)
        put(c, (5, 6), priority=1)
        put(c, (7, 8), priority=9)
        left = survivors_after_one_eviction(c, (1, 2), (3, 4), (5, 6), (7, 8))
        assert victim not in left and len(left) == 3, (policy, left)


def test_a_node_keeps_the_highest_priority_inserted_through_it_and_splits_keep_it():
    c = radix("priority")
    put(c, (1, 2, 3, 4), priority=5)
    dup = c.token_to_kv_pool_allocator.alloc(3)
    c.insert(InsertParams(key=K(1, 2, 9), value=dup, priority=0))  # splits [1, 2] off [1, 2, 3, 4]
    c.token_to_kv_pool_allocator.free(dup[:2])
    upper = c.match_prefix(MatchPrefixParams(key=K(1, 2))).last_device_node
    lower = c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4))).last_device_node
    other = c.match_prefix(MatchPrefixParams(key=K(1, 2, 9))).last_device_node
    assert (upper.priority, lower.priority, other.priority) == (5, 5, 0)
    again = c.token_to_kv_pool_allocator.alloc(3)
    assert c.insert(InsertParams(key=K(1, 2, 9), value=again, priority=7)).prefix_len == 3
    c.token_to_kv_pool_allocator.free(again)  # all duplicates
    assert (upper.priority, other.priority) == (7, 7)  # raised by a later, higher insert; never lowered
    c.check_integrity()


def test_priority_orders_hicache_device_and_host_eviction():
    h = make_hicache(page_size=1, device_pages=4, host_pages=4, eviction_policy="priority")
    alloc = h.token_to_kv_pool_allocator
    for ids, prio in (((1, 2), 3), ((5, 6), 0)):  # (1, 2) is older but more important
        h.insert(InsertParams(key=K(*ids), value=alloc.alloc(2), priority=prio))
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 2
    assert cached(h, 1, 2) and not cached(h, 5, 6)  # (5, 6) is on host only now
    h.insert(InsertParams(key=K(9, 9), value=alloc.alloc(2), priority=8))
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4  # all to host: host is full
    h.check_integrity()
    host_only = {ids: h.match_prefix(MatchPrefixParams(key=K(*ids))).host_hit_length for ids in ((1, 2), (5, 6), (9, 9))}
    assert host_only == {(1, 2): 2, (5, 6): 0, (9, 9): 2}, host_only  # the host tier dropped the lowest
    h.check_integrity()
    h.cache_controller.close()


def test_a_requests_priority_reaches_the_tree():
    assert GenerateReqInput.from_json({"text": "hi", "priority": 4}).priority == 4
    for bad in (True, 1.5, "1", 1 << 63):
        with pytest.raises(BadRequestError, match="priority"):
            GenerateReqInput.from_json({"text": "hi", "priority": bad}).check_values()
    req = Req(TokenizedGenerateReqInput("r", [1, 2, 3, 4], SamplingParams(), priority=6), eos_token_ids=[0])
    assert req.priority == 6
    assert Req(TokenizedGenerateReqInput("s", [1], SamplingParams()), eos_token_ids=[0]).priority == 0
    c = radix("priority")
    slots = c.token_to_kv_pool_allocator.alloc(4)
    fake = SimpleNamespace(fill_ids=[1, 2, 3, 4], kv_indices=slots, prefix_indices=torch.empty(0, dtype=torch.int64),
                           last_node=c.root_node, extra_key=None, priority=6)
    c.cache_finished_req(fake)
    assert c.match_prefix(MatchPrefixParams(key=K(1, 2, 3, 4))).last_device_node.priority == 6


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, config, words", [
    ("slru", {"protected": 2}, ["'slru'", "'protected'", "protected_threshold"]),
    ("lru", {"protected_threshold": 2}, ["'lru'", "no parameters"]),
    ("slru", {"protected_threshold": 0}, ["protected_threshold must be >= 1"]),
    ("slru", {"protected_threshold": "2"}, ["integer"]),
])
def test_policy_config_errors_name_the_key_and_the_policy(policy, config, words):
    with pytest.raises(ValueError) as err:
        CacheInitParams(eviction_policy=policy, eviction_policy_config=config)
    for w in words:
        assert w in str(err.value)


def test_tlru_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="unified radix tree"):
        radix("tlru")
    with pytest.raises(ValueError, match="--radix-eviction-policy tlru is refused: .*unified radix tree"):
        parse_args(["--model-path", "m", "--radix-eviction-policy", "tlru"])


def test_server_flags_reach_the_tree_params():
    args = parse_args(["--model-path", "m", "--radix-eviction-policy", "slru",
                       "--radix-eviction-policy-config", '{"protected_threshold": 4}'])
    assert args.eviction_policy_config == {"protected_threshold": 4}
    for value, words in (('{"bogus": 1}', "does not take 'bogus'"), ("[1]", "must be a JSON object"),
                         ("{", "not valid JSON")):
        with pytest.raises(ValueError, match="--radix-eviction-policy-config") as err:
            parse_args(["--model-path", "m", "--radix-eviction-policy", "slru",
                        "--radix-eviction-policy-config", value])
        assert words in str(err.value)
    assert make_radix(eviction_policy="slru").eviction_policy.value == "slru"
