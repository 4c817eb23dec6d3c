"""Admission consumes host writes that finished while the step was being planned.

Write-through locks a node until its host copy is acknowledged, so its memory is not evictable
meanwhile. A write that lands after the step's ``check_hicache_events`` used to keep that memory
from the waiting requests for a whole step: on a tight device pool HiCache-on prefills admitted
1-2 requests where HiCache off admitted 3 (issue 9, bench_scheduler_overhead ``finished``).
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
