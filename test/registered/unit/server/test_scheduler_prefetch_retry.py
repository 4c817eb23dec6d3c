"""L3 check retries in the scheduler (``--hicache-storage-prefetch-retry-poll-interval`` /
``-max-attempts``), on a tiny model.

The story: prompt A is served and its L3 backup hangs (ScriptedFileBackend ``hang_on: set``); a
flush empties the cache and leaves the backup running. Request R then runs alone on the idle
server (its check misses, it is admitted at once) and holds the memory that H, next in line,
needs; B (A's prompt plus a tail) waits behind H, its first check a miss because the backup has
not landed. Once the backup is released and has landed, B's check goes out again
``poll_interval`` steps after the miss and B is served from L3. With ``max_attempts`` 0 it never
goes out again (B is recomputed, same tokens); with the backup still hung B is re-checked exactly
``max_attempts`` times. H, the head, is never re-checked.
"""

import json
import sys
import time
from pathlib import Path

import pytest
from scheduler_fixtures import make_scheduler, prompts, request

from sglang.srt.mem_cache.controller.storage_ops import PrefetchState
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=8, suite="per-commit-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mem_cache"))
from storage_test_backends import scripted_extra  # noqa: E402

A = prompts(1, 24, seed=3)[0]
B = A + prompts(1, 8, seed=4)[0]  # A's 6 pages (24 tokens) can come from L3
R, H = prompts(2, 8, seed=5)
DEADLINE_S = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def scheduler(model, tmp_path, interval: int, max_attempts: int):
    extra = scripted_extra(tmp_path / "l3", hang_on=["set"], hang_max_s=DEADLINE_S, flush_timeout_s=0.2,
                           prefetch_threshold=4)
    return make_scheduler(model, page_size=4, max_total_tokens=160, enable_hierarchical_cache=True,
                          hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra),
                          hicache_storage_prefetch_retry_poll_interval=interval,
                          hicache_storage_prefetch_retry_max_attempts=max_attempts)


class Driver:
    """Steps the scheduler, collecting outputs and, after every step, the retry state of B and H."""

    def __init__(self, sched):
        self.sched, self.retries = sched, sched.tree_cache.storage_prefetch_retries
        self.steps, self.tokens, self.cached, self.finished = 0, {}, {}, set()
        self.attempts = {"b": [], "h": [], "r": []}
        self.first_armed_b = None

    def step(self):
        assert self.steps < 20000, "no progress"
        for out in self.sched.step():
            self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish is not None:
                self.finished.add(out.rid)
                self.cached[out.rid] = out.cached_tokens
        self.steps += 1
        for rid in self.attempts:
            self.attempts[rid].append(self.retries.attempts(rid))
        if self.first_armed_b is None and self.retries.is_armed("b"):
            self.first_armed_b = self.steps
        time.sleep(0.0005)  # storage threads run meanwhile (not a synchronization: loops test state)

    def answered(self, rid) -> bool:
        """``rid``'s check got its (agreed) answer; it waits behind the head, so its prefetch stays."""
        op = self.sched.tree_cache.ongoing_prefetch.get(rid)
        return op is not None and op.state is PrefetchState.FINISHED

    def until(self, cond, what):
        end = time.monotonic() + DEADLINE_S
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            self.step()


def story(model, tmp_path, interval, max_attempts, release_backup: bool) -> Driver:
    sched = scheduler(model, tmp_path, interval, max_attempts)
    backend = sched.tree_cache.cache_controller.storage_backend
    d = Driver(sched)
    try:
        sched.handle_messages([request("a", A, max_new=4)])
        d.until(lambda: "a" in d.finished and backend.wait_hanging(0), "A served and its backup hung")
        out = sched.flush_cache()
        assert not out.ok and out.payload.get("flush_incomplete"), out  # the backup still runs
        sched.handle_messages([request("r", R, max_new=40)])  # alone on an idle server, cold L3
        d.until(lambda: any(q.rid == "r" for q in sched.running), "R admitted")
        sched.handle_messages([request("h", H, max_new=110), request("b", B, max_new=4)])
        d.until(lambda: d.answered("b"), "B's first check to miss")
        if release_backup:
            backend.release_hangs()
            assert sched.tree_cache.storage.synchronize(DEADLINE_S)  # A's pages have landed
        d.until(lambda: {"r", "h", "b"} <= d.finished, "every request to finish")
        backend.release_hangs()
        d.until(sched.is_idle, "the backups to finish")
        checks = sched.stats.counters.num_idle_checks
        sched.on_idle()  # integrity, and no retry record left behind
        assert sched.stats.counters.num_idle_checks == checks + 1
        return d
    finally:
        backend.release_hangs()
        sched.shutdown()


def first_step_with(counts, n):
    return next(i + 1 for i, c in enumerate(counts) if c >= n)


@pytest.fixture(scope="module")
def hit(model, tmp_path_factory):
    return story(model, tmp_path_factory.mktemp("hit"), interval=3, max_attempts=8, release_backup=True)


def test_the_check_is_reissued_after_poll_interval_steps_and_hits(hit):
    d = hit
    assert d.cached["b"]["storage"] == 24, d.cached["b"]
    assert max(d.attempts["b"]) == 1
    # the miss is armed at step j; its first pass sets it due 3 passes later (j + 3, or j + 4 when
    # the answer was consumed during admission, after that step's pass)
    assert 3 <= first_step_with(d.attempts["b"], 1) - d.first_armed_b <= 4
    assert max(d.attempts["h"]) == 0 and max(d.attempts["r"]) == 0  # heads are never re-checked
    assert d.sched.tree_cache.storage_prefetch_retries.tracked() == 0


def test_max_attempts_zero_never_reissues_and_the_cap_holds(model, hit, tmp_path):
    off = story(model, tmp_path / "off", interval=3, max_attempts=0, release_backup=True)
    assert max(off.attempts["b"]) == 0 and off.cached["b"]["storage"] == 0
    capped = story(model, tmp_path / "cap", interval=1, max_attempts=2, release_backup=False)
    assert max(capped.attempts["b"]) == 2 and capped.cached["b"]["storage"] == 0
    assert off.tokens["b"] == hit.tokens["b"] == capped.tokens["b"]  # from L3 or recomputed: the same
