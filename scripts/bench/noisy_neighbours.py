"""Noisy neighbours for benchmarks: N processes that load the host beside a server under test.

    with NoisyNeighbours(4):      # 2 CPU-bound + 2 file-I/O processes
        run_the_benchmark()

Kinds alternate ``cpu``, ``io``: a ``cpu`` neighbour runs Python arithmetic and small numpy
matrix products without pause; an ``io`` neighbour writes a 16 MiB file in 1 MiB blocks, fsyncs,
reads it back and deletes it, in a loop, in its own temporary directory. They are separate
processes (not threads), so they compete with the server for cores, caches and the disk but not
for its GIL. ``stop()`` (or leaving the ``with``) terminates them by their process handles and
removes their files; a neighbour that outlives its parent notices and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

KINDS = ("cpu", "io")
IO_FILE_BYTES = 16 << 20
IO_BLOCK_BYTES = 1 << 20


def _cpu_loop(parent: int) -> None:
    import numpy as np

    a = np.random.default_rng(0).random((96, 96))
    while os.getppid() == parent:
        x = 0
        for i in range(20000):
            x += i * i % 7
        a = (a @ a) / 96.0


def _io_loop(parent: int, directory: str) -> None:
    block = os.urandom(IO_BLOCK_BYTES)
    path = os.path.join(directory, f"neighbour-{os.getpid()}.bin")
    while os.getppid() == parent:
        with open(path, "wb") as f:
            for _ in range(IO_FILE_BYTES // IO_BLOCK_BYTES):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            while f.read(IO_BLOCK_BYTES):
                pass
        os.remove(path)


class NoisyNeighbours:
    """``count`` neighbour processes, kinds alternating ``cpu`` / ``io`` (0: none)."""

    def __init__(self, count: int):
        if count < 0:
            raise ValueError(f"--noisy-neighbours must be >= 0, got {count}")
        self.count = count
        self.procs: list[mp.Process] = []
        self.kinds = [KINDS[i % len(KINDS)] for i in range(count)]
        self._dir: str | None = None

    def start(self) -> "NoisyNeighbours":
        if not self.count:
            return self
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="noisy-neighbours-")
        parent = os.getpid()
        for kind in self.kinds:
            target, extra = (_cpu_loop, ()) if kind == "cpu" else (_io_loop, (self._dir,))
            proc = ctx.Process(target=target, args=(parent, *extra), daemon=True, name=f"neighbour-{kind}")
            proc.start()
            self.procs.append(proc)
        time.sleep(0.2)  # let them reach their loops before the measurement starts
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def describe(self) -> str:
        return ", ".join(f"{k} x{self.kinds.count(k)}" for k in KINDS if k in self.kinds) or "none"

    def __enter__(self) -> "NoisyNeighbours":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
