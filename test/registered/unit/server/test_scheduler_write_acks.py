"""Admission consumes host writes that finished while the step was being planned.

Write-through locks a node until its host copy is acknowledged, so its memory is not evictable
meanwhile. A write that lands after the step's ``check_hicache_events`` used to keep that memory
from the waiting requests for a whole step: on a tight device pool HiCache-on prefills admitted
1-2 requests where HiCache off admitted 3 (issue 9, bench_scheduler_overhead ``finished``).

Also: a batch makes room for all its requests in one eviction pass, and an abort between steps
starts the backup it made due at once (the step no longer flushes at its start).
"""

import pytest
from scheduler_fixtures import make_scheduler, prompts, request

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=6, suite="per-commit-cpu")

PAGE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def finish(sched, req) -> None:
    sched.handle_messages([req])
    for _ in range(200):
        if any(out.finish is not None for out in sched.step()):
            return
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("ack_during_admission", [True, False])
def test_write_finished_after_step_start_frees_memory_for_admission(model, ack_during_admission, monkeypatch):
    sched = make_scheduler(model, page_size=PAGE, max_total_tokens=8 * PAGE, enable_hierarchical_cache=True,
                           hicache_ratio=4)
    if not ack_during_admission:  # the old behaviour: acks only at the start of a step
        monkeypatch.setattr(sched, "_ack_finished_writes", lambda: False)
    first, second = prompts(2, 5 * PAGE, seed=3)
    finish(sched, request("a", first, max_new=1))
    tree = sched.tree_cache
    assert tree.ongoing_write_through, "the finished prompt's pages are being written to host"
    tree.cache_controller.synchronize_writes()  # the write lands after this step's acks ran
    sched.handle_messages([request("b", second, max_new=1)])  # needs the memory "a" left in the tree
    adder = sched._build_prefill()
    if ack_during_admission:
        assert adder is not None and [r.rid for r, _ in adder.entries] == ["b"]
        assert not tree.ongoing_write_through
    else:
        assert adder is None and [r.rid for r in sched.waiting] == ["b"]
    while sched.has_work() or sched.transfers_in_flight():  # both ways end clean
        if adder is not None:
            sched._run_prefill(adder)
            adder = None
        sched.step()
    sched.check_integrity()
    sched.shutdown()


def count_evictions(sched, monkeypatch) -> list[int]:
    calls = []
    real = sched.tree_cache.evict

    def evict(params):
        calls.append(params.num_tokens)
        return real(params)

    monkeypatch.setattr(sched.tree_cache, "evict", evict)
    return calls


@pytest.mark.parametrize("hicache", [False, True])
def test_a_batch_makes_room_in_one_eviction(model, hicache, monkeypatch):
    """One eviction pass per batch, as upstream allocates a batch's slots in one call: a pass
    per request walked the tree and freed device slots once per request."""
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=4) if hicache else {}
    sched = make_scheduler(model, page_size=PAGE, max_total_tokens=16 * PAGE, **extra)
    for i, ids in enumerate(prompts(3, 4 * PAGE, seed=5)):
        finish(sched, request(f"cached{i}", ids, max_new=1))  # the tree holds 12 of 16 pages
    if hicache:
        sched.slots.flush_host_writes()  # acknowledged: the cached pages are evictable
    free_before = sched.runner.token_to_kv_pool_allocator.available_size()
    calls = count_evictions(sched, monkeypatch)
    sched.handle_messages([request(f"new{i}", ids, max_new=2) for i, ids in enumerate(prompts(3, 3 * PAGE, seed=6))])
    adder = sched._build_prefill()
    assert adder is not None and len(adder.entries) == 3
    sched._run_prefill(adder)
    need = 3 * 3 * PAGE  # three prompts of three pages, none cached
    assert calls == [need - free_before]  # the batch's shortfall, once
    while sched.has_work() or sched.transfers_in_flight():
        sched.step()
    sched.check_integrity()
    sched.shutdown()


def test_abort_between_steps_starts_the_backup_it_made_due(model):
    sched = make_scheduler(model, page_size=PAGE, max_total_tokens=16 * PAGE, enable_hierarchical_cache=True,
                           hicache_ratio=4)
    tree = sched.tree_cache
    sched.handle_messages([request("a", prompts(1, 4 * PAGE, seed=7)[0], max_new=50)])
    for _ in range(3):
        sched.step()
    assert [r.rid for r in sched.running] == ["a"]
    sched.abort_request("a")  # between steps: its KV goes to the tree, its backup is due
    assert not tree._due_backups and tree.ongoing_write_through  # started at once, not at the next step
    while sched.has_work() or sched.transfers_in_flight():
        sched.step()
    sched.check_integrity()
    sched.shutdown()
