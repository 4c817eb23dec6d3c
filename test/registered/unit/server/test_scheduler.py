"""Scheduler storylines, in process on a tiny model: continuous batching, chunked prefill,
eviction under pressure, HiCache load-back, abort, refusal, flush, idle integrity checks.

Greedy outputs of any schedule must equal those of the same prompt run alone on a big pool
(the engine is batch-invariant), and ``check_integrity`` must hold after every step.
"""

import pytest
import torch
from scheduler_fixtures import Result, abort, drive, make_scheduler, prompts, request, run_each

from sglang.srt.managers.io_struct import ControlKind, ControlReq
from sglang.srt.mem_cache.radix.integrity import CacheIntegrityError
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=25, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture(scope="module")
def reference(model):
    """Each prompt alone on a pool that holds everything: the expected tokens."""
    sched = make_scheduler(model, max_total_tokens=16384)
    cache = {}

    def expect(ids, max_new=8) -> Result:
        key = (tuple(ids), max_new)
        if key not in cache:
            sched.flush_cache()
            cache[key] = drive(sched, {0: [request("ref", ids, max_new)]})["ref"]
        return cache[key]

    return expect


def assert_same(results: dict, reqs: list, reference) -> None:
    for r in reqs:
        want = reference(r.input_ids, r.sampling_params.max_new_tokens)
        assert results[r.rid].tokens == want.tokens, r.rid
        assert results[r.rid].logprobs == want.logprobs, r.rid


def test_continuous_batching_joins_running_batch(model, reference):
    sched = make_scheduler(model)
    reqs = [request(f"r{i}", p, max_new=12) for i, p in enumerate(prompts(5, (10, 60), seed=1))]
    schedule = {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]}  # later requests arrive while others decode
    results = drive(sched, schedule)
    assert_same(results, reqs, reference)
    c = sched.stats.counters
    # 3 admissions + 12 decode steps per request, overlapped: far fewer than 5 * 12 decode steps
    assert c.num_prefill_batches == 3
    assert c.num_decode_batches < 30
    assert c.num_requests == 5 and c.generation_tokens == 60


def test_chunked_prefill_splits_long_prompts(model, reference):
    sched = make_scheduler(model, chunked_prefill_size=16, page_size=4)
    long, short = prompts(1, 70, seed=2)[0], prompts(1, 9, seed=3)[0]
    reqs = [request("long", long), request("short", short)]
    results = drive(sched, {0: reqs})
    assert_same(results, reqs, reference)
    # 70 prompt tokens at 16 per step: 5 prefill batches; "short" rides in the last one
    assert sched.stats.counters.num_prefill_batches == 5


def test_radix_reuse_counts_device_hits(model, reference):
    sched = make_scheduler(model, page_size=4)
    base = prompts(1, 40, seed=4)[0]
    first, second = request("a", base + [5, 6, 7]), request("b", base + [8, 9])
    results = run_each(sched, [first, second])
    assert_same(results, [first, second], reference)
    assert results["a"].cached["device"] == 0
    assert results["b"].cached == {"device": 40, "host": 0, "storage": 0}  # whole pages of the shared 40


def test_eviction_under_memory_pressure(model, reference):
    sched = make_scheduler(model, max_total_tokens=256, page_size=4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(prompts(8, (40, 90), seed=5))]
    results = drive(sched, {0: reqs})  # more than the pool at once: admission waits, eviction frees
    assert_same(results, reqs, reference)
    assert sched.tree_cache.total_size() <= 256


def test_hicache_load_back_is_token_identical(model, reference):
    sched = make_scheduler(model, max_total_tokens=256, page_size=4, enable_hierarchical_cache=True,
                           hicache_ratio=8)
    ps = prompts(6, 100, seed=6)
    first = [request(f"a{i}", p) for i, p in enumerate(ps)]
    again = [request(f"b{i}", p + [11, 12]) for i, p in enumerate(ps)]
    results = run_each(sched, first + again)
    assert_same(results, first + again, reference)
    for i in range(6):  # each prompt left the device long ago: all of it comes back from host
        assert results[f"b{i}"].cached == {"device": 0, "host": 100, "storage": 0}
    host = sched.tree_cache.cache_controller.mem_pool_host
    assert host.size - host.available_size() >= 600


def test_abort_in_every_state_frees_everything(model):
    sched = make_scheduler(model, max_total_tokens=512, chunked_prefill_size=16, page_size=4)
    ps = prompts(3, 60, seed=7)
    reqs = [request("run", ps[0], max_new=50), request("chunk", ps[1], max_new=50), request("wait", ps[2], 400)]
    sched.handle_messages(reqs)
    for _ in range(6):  # "run" decodes, "chunk" is part-prefilled, "wait" cannot fit yet
        sched.step()
        sched.check_integrity()
    assert [r.rid for r in sched.running] == ["run"]
    assert sched.chunked_req is not None and sched.chunked_req.rid == "chunk"
    assert [r.rid for r in sched.waiting] == ["wait"]
    results = drive(sched, {0: [abort("wait"), abort("chunk"), abort("run"), abort("unknown")]})
    assert {rid: r.finish["type"] for rid, r in results.items()} == {"wait": "abort", "chunk": "abort", "run": "abort"}
    assert not sched.has_work()
    assert sched.stats.counters.num_aborted == 3
    assert sched.flush_cache().ok
    assert sched.runner.token_to_kv_pool_allocator.available_size() == 512


def test_refuses_requests_that_can_never_fit(model):
    sched = make_scheduler(model, max_total_tokens=128)
    results = drive(sched, {0: [request("big", prompts(1, 100)[0], max_new=40), request("neg", [5, 1000, 7])]})
    assert results["big"].finish["type"] == "abort" and "KV pool" in results["big"].finish["message"]
    assert results["neg"].finish["type"] == "abort" and "token ids" in results["neg"].finish["message"]
    assert results["big"].tokens == [] and not sched.has_work()


def test_stop_conditions(model, reference):
    sched = make_scheduler(model)
    ids = prompts(1, 20, seed=8)[0]
    free = reference(ids, 8).tokens
    results = drive(sched, {0: [request("stop_id", ids, stop_token_ids=[free[2]]), request("zero", ids, max_new=0)]})
    assert results["stop_id"].tokens == free[:3]
    assert results["stop_id"].finish == {"type": "stop", "matched": free[2]}
    assert results["zero"].tokens == [] and results["zero"].finish == {"type": "length"}
    text = sched.tokenizer.decode(free[3:5])
    results = drive(sched, {0: [request("stop_str", ids, stop=[text])]})
    assert results["stop_str"].finish["type"] == "stop" and len(results["stop_str"].tokens) <= 5


def test_flush_is_refused_while_busy_and_frees_all_when_idle(model):
    sched = make_scheduler(model, max_total_tokens=512, enable_hierarchical_cache=True)
    sched.handle_messages([request("x", prompts(1, 30)[0], max_new=20)])
    sched.step()
    busy = sched.handle_messages([ControlReq(7, ControlKind.FLUSH_CACHE)])[0]
    assert busy.cid == 7 and not busy.ok and "in flight" in busy.message
    drive(sched, {})
    stats = sched.handle_messages([ControlReq(8, ControlKind.GET_STATS)])[0].payload
    assert stats["pools"]["host"]["used_tokens"] > 0
    assert sched.flush_cache().ok
    host = sched.tree_cache.cache_controller.mem_pool_host
    assert host.available_size() == host.size
    assert sched.runner.token_to_kv_pool_allocator.available_size() == 512


def test_idle_check_runs_once_per_idle_period_and_catches_leaks(model):
    sched = make_scheduler(model, max_total_tokens=512)
    drive(sched, {0: [request("x", prompts(1, 30)[0])]})
    assert sched.stats.counters.num_idle_checks == 1
    sched.on_idle()
    assert sched.stats.counters.num_idle_checks == 1  # nothing happened since
    sched.handle_messages([request("y", prompts(1, 30, seed=1)[0])])
    drive(sched, {})
    assert sched.stats.counters.num_idle_checks == 2
    leaked = sched.runner.token_to_kv_pool_allocator.alloc(4)  # a slot nobody owns
    assert leaked is not None
    sched.handle_messages([request("z", prompts(1, 30, seed=2)[0])])
    with pytest.raises(CacheIntegrityError, match="neither free nor owned"):
        drive(sched, {}, check=False)
    sched.runner.token_to_kv_pool_allocator.free(leaked)
    sched.check_integrity()


def test_sampled_decoding_is_reproducible_with_seed(model):
    sched = make_scheduler(model)
    ids = prompts(1, 15, seed=9)[0]
    a = drive(sched, {0: [request("a", ids, 10, temperature=1.0, sampling_seed=7)]})["a"]
    b = drive(sched, {0: [request("b", ids, 10, temperature=1.0, sampling_seed=7),
                          request("c", ids[:5], 10, temperature=1.0, sampling_seed=8)]})["b"]
    assert a.tokens == b.tokens
    assert torch.tensor(a.logprobs).isfinite().all()


def test_duplicate_prefix_computed_twice_is_shared_after_insert(model, reference):
    """A and B compute the same prefix in one batch; B's copy is freed when it inserts, so its
    request row must point at A's slots before C reuses the freed ones."""
    sched = make_scheduler(model, page_size=4, max_total_tokens=160)  # so C gets B's freed pages
    base = prompts(1, 48, seed=10)[0]
    a, b = request("a", base + [3, 4], max_new=16), request("b", base + [5], max_new=16)
    c = request("c", prompts(1, 60, seed=11)[0], max_new=4)
    results = drive(sched, {0: [a, b], 2: [c]})
    assert_same(results, [a, b, c], reference)
