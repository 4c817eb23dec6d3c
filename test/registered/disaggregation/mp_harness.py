"""Start prefill and decode rank processes, collect their reports, always clean up.

Each rank runs in its own spawned process (``pd_workers``) with a private pipe to the test;
the bootstrap server lives in prefill rank 0. Every wait has a deadline and ``Cluster.close``
kills whatever is left, so a failing test never leaves processes behind or hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection, wait

import pd_workers

BASE_CFG = {
    "page_size": 4,
    "pool_tokens": 64,  # 16 usable pages, ids 1..16
    "layers": 2,
    "head_dim": 4,
    "heads": 4,
    "mla": False,
    "state_rows": 0,
    "src_pages": [9, 3, 4, 14, 7, 1, 12],
    "dst_pages": [2, 11, 12, 5, 16, 8, 9],
    "chunks": [3, 4],
    "aux_src": 5,
    "aux_dst": 2,
    "state_src": 3,
    "state_dst": 1,
    "room": 4242,
    "hb_timeout": 3.0,
    "transfer_timeout": 30.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, cfg: dict, prefill_tp: int, decode_tp: int):
        self.cfg = dict(BASE_CFG, **cfg, bootstrap_port=free_port())
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        ctx = mp.get_context("spawn")
        self.procs: dict[tuple[str, int], mp.Process] = {}
        self.conns: dict[tuple[str, int], Connection] = {}
        ranks = [("prefill", r, pd_workers.prefill_main, (self.cfg, prefill_tp, r)) for r in range(prefill_tp)]
        ranks += [("decode", r, pd_workers.decode_main, (self.cfg, decode_tp, r, prefill_tp)) for r in range(decode_tp)]
        for role, r, target, args in ranks:
            mine, theirs = ctx.Pipe(duplex=True)
            self.procs[(role, r)] = ctx.Process(target=target, args=(*args, theirs), daemon=True)
            self.conns[(role, r)] = mine
        for p in self.procs.values():
            p.start()
        self.reports: dict[tuple[str, int], dict] = {}
        self.signals: list[tuple[str, int]] = []

    def _recv_some(self, timeout: float) -> None:
        for conn in wait(list(self.conns.values()), timeout):
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the process died: stop listening to it
                self.conns = {k: c for k, c in self.conns.items() if c is not conn}
                continue
            if msg[0] == "error":
                raise AssertionError(f"{msg[1]} raised:\n{msg[2]}")
            if msg[0] in ("prefill", "decode"):
                self.reports[(msg[0], msg[1])] = msg[2]
            else:
                self.signals.append((msg[0], msg[1]))

    def wait_for(self, want: set[tuple[str, int]], timeout: float) -> None:
        """Collect messages until every key in ``want`` (reports or signals) arrived."""
        deadline = time.monotonic() + timeout
        while not want <= (set(self.reports) | set(self.signals)):
            left = deadline - time.monotonic()
            if left <= 0 or not self.conns:
                alive = [k for k, p in self.procs.items() if p.is_alive()]
                raise TimeoutError(f"waited {timeout}s for {sorted(want)}; got reports {sorted(self.reports)}, "
                                   f"signals {self.signals}, alive {alive}")
            self._recv_some(min(left, 1.0))

    def all_reports(self, timeout: float = 90) -> dict:
        keys = {("prefill", r) for r in range(self.prefill_tp)} | {("decode", r) for r in range(self.decode_tp)}
        self.wait_for(keys, timeout)
        return self.reports

    def command(self, role: str, rank: int, command: str) -> None:
        conn = self.conns.get((role, rank))
        if conn is not None:
            try:
                conn.send(command)
            except (BrokenPipeError, OSError):
                pass

    def kill(self, role: str, rank: int) -> None:
        p = self.procs[(role, rank)]
        p.kill()
        p.join(10)

    def close(self) -> None:
        for key in list(self.conns):
            self.command(*key, "stop")
        for p in self.procs.values():
            p.join(5)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns.values():
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
