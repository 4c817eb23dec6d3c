"""--schedule-policy and --schedule-conservativeness: queue orders with exact expectations,
greedy outputs identical under every policy, reservations, refused values, and waiting requests
that reuse their match while the tree does not change."""

import dataclasses

import pytest
from scheduler_fixtures import drive, make_scheduler, prompts, request

from sglang.srt.managers.schedule_policy import SchedulePolicy, WaitingQueueOrder
from sglang.srt.server_args import SCHEDULE_POLICIES, ServerArgs, parse_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=8, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def test_flags_defaults_choices_and_refusals():
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert fields["schedule_policy"].default == "fcfs"  # upstream's default
    assert fields["schedule_conservativeness"].default == 1.0
    assert set(SCHEDULE_POLICIES) == {p.value for p in SchedulePolicy}
    parsed = parse_args(["--model-path", "/m", "--schedule-policy", "lpm", "--schedule-conservativeness", "1.5"])
    assert (parsed.schedule_policy, parsed.schedule_conservativeness) == ("lpm", 1.5)
    with pytest.raises(ValueError, match="--schedule-policy 'dfs-weight' is not allowed; choose one of: fcfs, lpm"):
        ServerArgs(model_path="/m", schedule_policy="dfs-weight")
    with pytest.raises(ValueError, match=r"--schedule-conservativeness 0.5 is invalid; must be in \[1.0, 100.0\]"):
        ServerArgs(model_path="/m", schedule_conservativeness=0.5)


def _queue(sched, msgs):
    sched.handle_messages(msgs)
    return list(sched.waiting)


def test_lpm_orders_by_cached_prefix_then_arrival(model):
    sched = make_scheduler(model, page_size=4, schedule_policy="lpm")
    base = prompts(1, 32, seed=7)[0]
    drive(sched, {0: [request("seed", base + [5, 6, 7, 8], max_new=1)]})
    waiting = _queue(sched, [
        request("none", prompts(1, 20, seed=8)[0]),
        request("half", base[:16] + [9] * 8),
        request("full", base + [4] * 8),
        request("half2", base[:16] + [8] * 8),
    ])
    sched.queue_order.apply(sched.waiting)
    assert [r.rid for r in sched.waiting] == ["full", "half", "half2", "none"]
    # the ordering matched each request once; a second ordering reuses every match
    matches = [r.cached_match for r in waiting]
    sched.queue_order.apply(sched.waiting)
    assert [r.cached_match for r in waiting] == matches
    assert all(a is b for a, b in zip([r.cached_match for r in waiting], matches))


def test_lof_and_random_orders(model):
    sched = make_scheduler(model, schedule_policy="lof")
    _queue(sched, [request(f"r{i}", [3, 4, 5], max_new=n) for i, n in enumerate((2, 9, 5, 9))])
    sched.queue_order.apply(sched.waiting)
    assert [r.rid for r in sched.waiting] == ["r1", "r3", "r2", "r0"]  # stable: r1 arrived before r3
    reqs = list(sched.waiting)
    a = WaitingQueueOrder("random", sched.tree_cache, seed=3)
    b = WaitingQueueOrder("random", sched.tree_cache, seed=3)
    qa, qb = type(sched.waiting)(reqs), type(sched.waiting)(reqs)
    a.apply(qa)
    b.apply(qb)
    assert list(qa) == list(qb) and sorted(map(id, qa)) == sorted(map(id, reqs))


def test_greedy_outputs_identical_under_every_policy(model):
    shared = prompts(1, 24, seed=11)[0]
    ids = prompts(6, (6, 30), seed=12, prefix=shared) + prompts(2, 20, seed=13)
    results = {}
    for policy in SCHEDULE_POLICIES:
        sched = make_scheduler(model, page_size=4, max_total_tokens=256, chunked_prefill_size=32,
                               schedule_policy=policy)
        reqs = [request(f"q{i}", p, max_new=6) for i, p in enumerate(ids)]
        out = drive(sched, {0: reqs[:5], 2: reqs[5:]})  # check_integrity after every step
        results[policy] = {rid: r.tokens for rid, r in out.items()}
        assert all(len(t) == 6 for t in results[policy].values())
        sched.on_idle()
        assert sched.stats.counters.num_idle_checks >= 1
    for policy in SCHEDULE_POLICIES:
        assert results[policy] == results["fcfs"], policy


def test_conservativeness_scales_the_decode_reservation(model):
    for c, want_pages in ((1.0, (10 + 7 + 3) // 4), (2.0, -(-(10 + 14) // 4)), (100.0, 64 // 4)):
        sched = make_scheduler(model, page_size=4, max_total_tokens=64, schedule_conservativeness=c)
        sched.handle_messages([request("r", list(range(3, 13)), max_new=8)])
        sched.step()
        req = sched.running[0] if sched.running else sched.chunked_req
        assert req.max_pages == want_pages, c  # capped at the pool (64 tokens) for c = 100
        drive(sched, {})
        sched.check_integrity()


def test_blocked_waiting_request_reuses_its_match(model):
    sched = make_scheduler(model, page_size=4, max_total_tokens=64)
    sched.handle_messages([request("big", prompts(1, 40, seed=1)[0], max_new=12),
                           request("blocked", prompts(1, 30, seed=2)[0], max_new=4)])
    sched.step()  # "big" is admitted; "blocked" does not fit next to its reservation
    blocked = sched.waiting[0]
    assert blocked.rid == "blocked"
    first = blocked.cached_match
    assert first is not None
    for _ in range(3):  # decode steps: the tree does not change under "blocked"
        sched.step()
        assert sched.waiting[0] is blocked and blocked.cached_match is first
    drive(sched, {})
    sched.check_integrity()
