"""Run test code in threads so that a failure in any of them fails the test.

An ``assert`` (or any exception) inside a ``threading.Thread`` target only prints a traceback;
the test that started the thread still passes. ``run_in_threads`` collects what each thread
raised and re-raises it in the calling (test) thread, and fails when a thread is still running
after the deadline instead of waiting for it forever.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class ThreadFailure(AssertionError):
    """A thread started by ``run_in_threads`` raised, or did not finish by the deadline."""


def run_in_threads(fns: list[Callable[[], Any]], timeout_s: float = 120.0, start_together: bool = True) -> list[Any]:
    """Call every ``fns[i]()`` in its own thread; return their results in order.

    ``start_together``: the threads pass a barrier first, so they really overlap. Raises
    ThreadFailure (chained to the first exception, naming every failed thread) when any thread
    raised, or when one is still alive ``timeout_s`` seconds after the start.
    """
    barrier = threading.Barrier(len(fns)) if start_together and fns else None
    results: list[Any] = [None] * len(fns)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(i: int) -> None:
        try:
            if barrier is not None:
                barrier.wait(timeout_s)
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread below
            with lock:
                errors.append((i, exc))

    threads = [threading.Thread(target=body, args=(i,), name=f"test-thread-{i}", daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if errors:
        errors.sort(key=lambda e: e[0])
        names = ", ".join(f"thread {i}: {type(e).__name__}: {e}" for i, e in errors)
        raise ThreadFailure(f"{len(errors)} of {len(fns)} threads failed ({names})") from errors[0][1]
    if alive:
        raise ThreadFailure(f"threads still running after {timeout_s:.0f}s: {', '.join(alive)}")
    return results
