"""/flush_cache against a hung L3 backend: the scheduler reports an incomplete flush and keeps
serving (regression: an unbounded wait used to hang the scheduler loop)."""

import json
import sys
import time
from pathlib import Path

import pytest
from scheduler_fixtures import make_scheduler, prompts, request

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=15, suite="per-commit-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mem_cache"))
from storage_test_backends import scripted_extra  # noqa: E402


def serve_one(sched, req, deadline_s=60.0) -> list[int]:
    """Step until ``req`` finishes; a hung L3 backup may stay in flight after that."""
    sched.handle_messages([req])
    tokens = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for out in sched.step():
            tokens += out.token_ids
            if out.finish is not None:
                return tokens
        time.sleep(0.001)  # steps wait on transfer threads; do not spin them out of CPU
    raise AssertionError(f"request {req.rid} did not finish in {deadline_s} s")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


def test_flush_with_hung_backend_is_reported_and_serving_continues(model, tmp_path):
    extra = scripted_extra(tmp_path / "l3", hang_on=["set"], hang_max_s=30, flush_timeout_s=0.5, prefetch_threshold=4)
    sched = make_scheduler(
        model,
        page_size=4,
        enable_hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    backend = sched.tree_cache.cache_controller.storage_backend
    try:
        assert len(serve_one(sched, request("a", prompts(1, 24)[0], max_new=4))) == 4
        end = time.monotonic() + 30
        while not backend.wait_hanging(0.01):  # steps consume the host write ack, then back up
            assert time.monotonic() < end, "the L3 backup never started"
            sched.step()
        out = sched.flush_cache()
        assert backend.hanging_now() >= 1, "the flush waited for the hung backup"
        assert not out.ok and out.payload.get("flush_incomplete"), out
        # the cache was emptied and the scheduler still serves
        assert len(serve_one(sched, request("b", prompts(1, 20, seed=1)[0], max_new=4))) == 4
    finally:
        backend.release_hangs()
        sched.shutdown()
