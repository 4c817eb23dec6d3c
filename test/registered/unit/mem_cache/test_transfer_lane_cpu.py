"""Worker-thread lanes (issue 9): jobs keep submission order whichever thread runs them; a
``run_on_wait`` lane lets a waiter run the jobs the worker has not started, and runs a short job
in the submitting thread only while recent short jobs were shorter than a thread hand-off and
nothing is queued or running ahead of it; lock-gated CpuEvents keep Event semantics."""

import queue
import threading
import time

import pytest

from sglang.srt.mem_cache.controller import transfer_lane
from sglang.srt.mem_cache.controller.transfer_lane import CpuEvent, HiCacheTransferError, ThreadLane
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def recorder(seen: list, tag, ev: CpuEvent | None = None, sleep_s: float = 0.0):
    def job():
        if sleep_s:
            time.sleep(sleep_s)
        seen.append((tag, threading.current_thread().name))
        if ev is not None:
            ev.record()

    return job


def test_cpu_event_states_timeout_and_failure():
    ev = CpuEvent()
    assert ev.query() and ev.recorded
    ev.synchronize(0)  # recorded: returns at once
    ev.arm()
    ev.arm()  # arming a pending event keeps it pending (no deadlock)
    assert not ev.query()
    with pytest.raises(TimeoutError, match="not done after 0.01 s"):
        ev.synchronize(0.01)
    threading.Timer(0.05, ev.record).start()
    ev.wait()  # another thread records it
    assert ev.query()
    ev.record()  # a second record changes nothing
    ev.arm()
    ev.fail(OSError("boom"))
    assert ev.query() and isinstance(ev.error, OSError)
    with pytest.raises(HiCacheTransferError, match="boom"):
        ev.synchronize()
    ev.arm()  # re-armed: the old failure is forgotten
    assert ev.error is None and not ev.query()
    ev.record()
    ev.synchronize()


def test_waiter_runs_jobs_the_worker_has_not_started_in_order():
    lane = ThreadLane("steal", run_on_wait=True)
    real_wake = lane._wake
    lane._wake = queue.SimpleQueue()  # the worker keeps waiting on the old queue: nothing starts
    try:
        seen, events = [], [lane.new_event() for _ in range(3)]
        for i, ev in enumerate(events):
            lane.submit(recorder(seen, i, ev), [ev])
        assert seen == [] and not events[0].query()
        events[1].synchronize()  # runs jobs 0 and 1 here, leaves job 2 queued
        me = threading.current_thread().name
        assert seen == [(0, me), (1, me)] and not events[2].query()
        lane.synchronize()
        assert seen == [(0, me), (1, me), (2, me)]
        plain = CpuEvent(armed=True)  # an event of no lane never runs jobs
        assert plain._lane is None
    finally:
        lane._wake = real_wake
        lane.close()


def test_lane_without_run_on_wait_keeps_every_job_on_its_worker():
    lane = ThreadLane("plain")
    seen = []
    ev = lane.new_event()
    lane.submit(recorder(seen, "a", ev), [ev], short=True)  # short changes nothing here
    ev.synchronize()
    lane.synchronize()
    assert seen == [("a", "plain")] and lane.num_inline == 0
    lane.close()


def test_short_jobs_run_inline_only_while_short_and_never_ahead_of_queued_work(monkeypatch):
    monkeypatch.setattr(transfer_lane, "INLINE_MAX_S", 0.005)
    lane = ThreadLane("inline", run_on_wait=True)
    me = threading.current_thread().name
    seen = []
    lane.submit(recorder(seen, 0), [], short=True)  # nothing measured yet: the worker runs it
    lane.synchronize()
    lane.submit(recorder(seen, 1), [], short=True)  # measured short: runs here, now
    assert seen[-1] == (1, me) and lane.num_inline == 1
    lane.submit(recorder(seen, 2, sleep_s=0.02), [], short=True)  # inline, but long
    lane.submit(recorder(seen, 3), [], short=True)  # so this one goes to the worker
    lane.synchronize()
    assert lane.num_inline == 2
    # a job queued or running ahead of a short one keeps it off the submitting thread
    gate = threading.Event()
    lane._short_job_s = 0.0
    lane.submit(lambda: gate.wait(10), [])
    lane.submit(recorder(seen, 4), [], short=True)
    assert seen[-1][0] == 3
    gate.set()
    lane.synchronize()
    assert [tag for tag, _ in seen] == [0, 1, 2, 3, 4] and lane.num_inline == 2  # 0, 3, 4: not in submit
    lane.close()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: None, [], short=True)


def test_a_short_job_after_a_waiter_ran_the_queue_always_runs_inline(monkeypatch):
    """A waiter (synchronize) that ran a queued job leaves the worker a stale wake-up; the worker
    must not take the run lock for it, or the next short job goes to the worker (and its ack a
    step later). Each round: an unmeasured job is queued, synchronize runs it (here or on the
    worker), then a short job must run in submit."""
    monkeypatch.setattr(transfer_lane, "INLINE_MAX_S", float("inf"))
    lane = ThreadLane("stale-wake", run_on_wait=True)
    me = threading.current_thread().name
    seen = []
    for i in range(200):
        lane._short_job_s = float("inf")  # unmeasured again: queued for the worker
        lane.submit(recorder(seen, ("queued", i)), [], short=True)
        lane.synchronize()
        lane.submit(recorder(seen, ("inline", i)), [], short=True)
        assert seen[-1] == (("inline", i), me), i
    assert lane.num_inline == 200
    lane.close()


def test_failing_inline_job_fails_its_events_and_keeps_the_lane_usable(monkeypatch):
    monkeypatch.setattr(transfer_lane, "INLINE_MAX_S", 0.005)
    lane = ThreadLane("inline-fail", run_on_wait=True)
    lane.submit(lambda: None, [], short=True)
    lane.synchronize()
    ev = lane.new_event()

    def bad():
        raise OSError("injected copy failure")

    lane.submit(bad, [ev], short=True)
    assert lane.num_inline == 1 and ev.query() and isinstance(lane.error, OSError)
    with pytest.raises(HiCacheTransferError, match="injected copy failure"):
        ev.synchronize()
    seen = []
    lane.submit(recorder(seen, "after"), [], short=True)
    lane.synchronize()
    assert [tag for tag, _ in seen] == ["after"]
    lane.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


class _TorchEventBeforeRecord:
    """torch.cuda.Event as it answers before any record(): query() is True (CUDA's semantics for
    an event with no work), synchronize() and stream waits return at once. Stands in for the
    GPU here; test_transfer_lane_cuda.py checks the same with real events."""

    def __init__(self):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return True

    def synchronize(self):
        pass


def test_cuda_event_armed_without_its_job_is_not_done(monkeypatch):
    monkeypatch.setattr(transfer_lane.torch.cuda, "Event", _TorchEventBeforeRecord)
    monkeypatch.setattr(transfer_lane.torch.cuda, "current_stream", lambda: None)
    ev = transfer_lane.CudaEvent(armed=True)
    assert not ev.query()  # a deferred write's ack must wait for the copy, not pass at once
    for wait in (ev.synchronize, ev.wait):
        with pytest.raises(RuntimeError, match="never submitted"):
            wait()
    ev.record()
    assert ev.query()
    ev.synchronize()
    ev.fail(ValueError("copy failed"))
    assert ev.query()  # failed counts as done; synchronize raises the failure
    with pytest.raises(HiCacheTransferError):
        ev.synchronize()
