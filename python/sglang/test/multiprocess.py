"""Test helpers for multi-process runs on 127.0.0.1: a free port, and N ranks that report back.

``run_ranks`` never hangs a test: ranks that do not report by the deadline are killed, and the
caller sees only the results that arrived.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, *args, world_size: int = 2, timeout_s: float = 120.0, expect: int | None = None) -> dict[int, dict]:
    """Spawn ``target(rank, port, *args, out)`` for every rank (``port`` is a fresh free port);
    each puts one dict with a ``"rank"`` key on ``out``. Returns {rank: dict} of those that
    reported within ``timeout_s``; stragglers are killed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    expect = world_size if expect is None else expect
    procs = [ctx.Process(target=target, args=(rank, port, *args, out), daemon=True) for rank in range(world_size)]
    results: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < expect and time.monotonic() < deadline:
            try:
                res = out.get(timeout=1)
            except queue.Empty:
                continue
            results[res["rank"]] = res
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
