"""sglang.test.threads.run_in_threads: a failure in any thread fails the calling test, and a
thread that does not finish by the deadline is reported instead of waited for."""

import threading

import pytest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.threads import ThreadFailure, run_in_threads

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def test_results_come_back_in_order_and_the_threads_overlap():
    inside = threading.Barrier(3)  # passes only if all three run at once

    def work(i):
        inside.wait(30)
        return i * i

    assert run_in_threads([lambda i=i: work(i) for i in range(3)], timeout_s=30) == [0, 1, 4]


def test_an_assert_in_a_thread_fails_the_caller_with_its_cause():
    def bad():
        assert 1 + 1 == 3, "wrong sum"

    with pytest.raises(ThreadFailure, match=r"1 of 2 threads failed \(thread 1: AssertionError: wrong sum") as err:
        run_in_threads([lambda: None, bad], timeout_s=30)
    assert isinstance(err.value.__cause__, AssertionError)


def test_a_thread_past_the_deadline_is_reported():
    release = threading.Event()
    try:
        with pytest.raises(ThreadFailure, match="still running after"):
            run_in_threads([lambda: release.wait(60)], timeout_s=0.2, start_together=False)
    finally:
        release.set()
