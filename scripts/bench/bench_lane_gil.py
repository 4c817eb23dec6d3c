"""Do the host-transfer lanes stall the scheduler thread (GIL contention)? And does a busy
scheduler thread stall the lanes?

    OMP_NUM_THREADS=1 python scripts/bench/bench_lane_gil.py [--pages 64] [--layers 4] [--json FILE]

Two threads share one GIL in the scheduler process: the scheduler (Python: matching, batching)
and the write / load lanes (``transfer_lane.ThreadLane``) running ``backup_from_device_all_layer``
and ``load_to_device_per_layer``. Each time a lane enters native code it releases the GIL, and
getting it back while the scheduler runs Python can cost up to a switch interval (5 ms). A copy
made of hundreds of small native calls then takes seconds, and the scheduler, waiting for it,
waits that long (the convoy behind issue 9's slow passes).

Measured, in the same run (rounds interleaved, medians), for the ``direct`` routine in the tree and for a per-range baseline
(one ``ctypes.memmove`` per (page, layer) range, what ``direct`` did before):

- ``sched_ratio``: time of a fixed scheduler-like Python loop while both lanes copy, over the
  same loop alone (1.0: the lanes cost the scheduler nothing; this host has 2 cores);
- ``lane_ratio``: time of one lane job while the scheduler-like loop runs, over the job alone;
- ``handoffs``: GIL re-acquisitions one backup loses to a Python-bound loop, with the switch
  interval raised to 20 ms so each one shows above the noise (``forced_handoffs``), at
  ``--pages`` and at 4x as many pages: it must not grow with the pages moved.

Shapes: an MHA pool of a tiny model (the e2e tests' 2 KiB per page and layer) and of a
Llama-8B-like rank (32 KiB), scattered device pages, host pages scattered too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang.srt.mem_cache.kvcacheio import direct  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.controller.transfer_lane import ThreadLane  # noqa: E402
from sglang.test.kv_pools import make_host_pool  # noqa: E402

SHAPES = {  # name -> (kv heads, head dim, dtype): bytes per (page of 16, layer) per K or V
    "tiny-2KiB": (2, 16, torch.float32),
    "llama8b-32KiB": (8, 128, torch.bfloat16),
}


def per_range_copy_pages(src, dst, src_map, dst_map, src_slots, dst_slots, layers, views=None) -> None:
    """The baseline: one memmove (one GIL release) per merged (page, layer) range."""
    src_off, dst_off, lengths = direct.page_segments(src_map, dst_map, src_slots, dst_slots, layers,
                                                     src.element_size())
    sb, db = src.data_ptr(), dst.data_ptr()
    for s, d, n in zip(src_off, dst_off, lengths):
        ctypes.memmove(db + d, sb + s, n)


def scheduler_loop(iters: int) -> float:
    """A stand-in for a scheduler step: Python over lists and dicts, no native calls."""
    start = time.perf_counter()
    table: dict[int, int] = {}
    for i in range(iters):
        key = tuple(range(i % 64, i % 64 + 48))
        table[hash(key) & 1023] = sum(key)
    return time.perf_counter() - start


class Copier:
    """Backups and loads of the same scattered pages on the two real lanes."""

    def __init__(self, shape: str, pages: int, layers: int, seed: int = 0):
        heads, dim, dtype = SHAPES[shape]
        P = 16
        gen = torch.Generator().manual_seed(seed)
        self.device = MHATokenToKVPool((2 * pages + 1) * P, P, dtype, heads, dim, layers)
        self.host = make_host_pool(self.device, "layer_first", "direct", ratio=2.0)
        dev_pages = torch.randperm(2 * pages, generator=gen)[:pages] + 1
        host_pages = torch.randperm(self.host.page_num, generator=gen)[:pages]
        self.dev = (dev_pages[:, None] * P + torch.arange(P)).reshape(-1)
        self.hst = (host_pages[:, None] * P + torch.arange(P)).reshape(-1)
        self.bytes = pages * P * self.device.get_size_per_token()
        self.write_lane, self.load_lane = ThreadLane("bench-write"), ThreadLane("bench-load")

    def backup(self) -> None:
        self.host.backup_from_device_all_layer(self.device, self.hst, self.dev)

    def load(self) -> None:
        for layer in range(self.host.layer_num):
            self.host.load_to_device_per_layer(self.device, self.hst, self.dev, layer)

    def job_time(self, lane: ThreadLane, job) -> float:
        done, box = threading.Event(), {}

        def timed():
            t = time.perf_counter()
            job()
            box["s"] = time.perf_counter() - t
            done.set()

        lane.submit(timed, [])
        if not done.wait(600):
            raise RuntimeError("lane job did not finish in 600 s")
        return box["s"]

    def close(self) -> None:
        self.write_lane.close()
        self.load_lane.close()


def forced_handoffs(copier: Copier, repeat: int, interval_s: float = 0.02) -> float:
    """GIL re-acquisitions one backup loses to a Python-bound scheduler thread, amplified: with
    the switch interval raised to ``interval_s`` each one costs that long, so (job time while
    the loop runs - job time alone) / interval_s counts them above the timing noise."""
    alone = min(copier.job_time(copier.write_lane, copier.backup) for _ in range(repeat))
    jobs: list[float] = []
    runner = threading.Thread(target=lambda: jobs.extend(copier.job_time(copier.write_lane, copier.backup)
                                                         for _ in range(repeat)))
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        runner.start()
        while runner.is_alive():
            scheduler_loop(200)
        runner.join()
    finally:
        sys.setswitchinterval(before)
    return max(0.0, (statistics.median(jobs) - alone) / interval_s)


def measure(copier: Copier, loop_iters: int, repeat: int) -> dict:
    alone_loop = min(scheduler_loop(loop_iters) for _ in range(repeat))
    alone_job = min(copier.job_time(copier.write_lane, copier.backup) for _ in range(repeat))
    stop = threading.Event()

    def keep_copying(lane, job):
        while not stop.is_set():
            copier.job_time(lane, job)

    feeders = [threading.Thread(target=keep_copying, args=(copier.write_lane, copier.backup), daemon=True),
               threading.Thread(target=keep_copying, args=(copier.load_lane, copier.load), daemon=True)]
    for t in feeders:
        t.start()
    time.sleep(0.05)
    busy_loop = statistics.median(scheduler_loop(loop_iters) for _ in range(repeat))
    stop.set()
    for t in feeders:
        t.join(600)
    # the other direction: one job while the scheduler-like loop runs
    jobs: list[float] = []

    def run_jobs():
        for _ in range(repeat):
            jobs.append(copier.job_time(copier.write_lane, copier.backup))

    runner = threading.Thread(target=run_jobs)
    runner.start()
    while runner.is_alive():
        scheduler_loop(2000)
    runner.join()
    busy_job = statistics.median(jobs)
    return {"loop_alone_s": alone_loop, "loop_with_copies_s": busy_loop, "sched_ratio": busy_loop / alone_loop,
            "job_alone_s": alone_job, "job_with_scheduler_s": busy_job, "lane_ratio": busy_job / alone_job,
            "backup_gbps_alone": copier.bytes / alone_job / 1e9}


def run_impl(copier: Copier, impl: str, args, big: Copier) -> dict:
    original = direct.copy_pages
    if impl == "per-range":
        direct.copy_pages = per_range_copy_pages
    try:
        rec = measure(copier, args.loop_iters, args.repeat)
        rec["handoffs"] = forced_handoffs(copier, args.repeat)
        rec["handoffs_4x_pages"] = forced_handoffs(big, args.repeat)
        return rec
    finally:
        direct.copy_pages = original


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64, help="scattered pages per job (of 16 tokens)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loop-iters", type=int, default=60000, help="iterations of the scheduler-like loop")
    parser.add_argument("--repeat", type=int, default=3, help="timings per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per impl, interleaved; medians shown")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", help="write the records to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = []
    print(f"{'shape':<15} {'impl':<10} {'sched_ratio':>11} {'lane_ratio':>10} {'job alone ms':>12} "
          f"{'job busy ms':>11} {'GB/s':>6} {'handoffs':>8} {'at 4x pages':>11}   (medians of {args.rounds} rounds)")
    for shape in args.shapes.split(","):
        copier, big = Copier(shape, args.pages, args.layers), Copier(shape, 4 * args.pages, args.layers, seed=1)
        try:
            runs: dict[str, list[dict]] = {"per-range": [], "direct": []}
            for _ in range(args.rounds):
                for impl in runs:
                    runs[impl].append(run_impl(copier, impl, args, big))
        finally:
            copier.close()
            big.close()
        for impl, rs in runs.items():
            rec = {"shape": shape, "impl": impl, "pages": args.pages, "layers": args.layers, "rounds": rs,
                   **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
            records.append(rec)
            print(f"{shape:<15} {impl:<10} {rec['sched_ratio']:>11.2f} {rec['lane_ratio']:>10.1f} "
                  f"{rec['job_alone_s'] * 1e3:>12.2f} {rec['job_with_scheduler_s'] * 1e3:>11.2f} "
                  f"{rec['backup_gbps_alone']:>6.2f} {rec['handoffs']:>8.1f} {rec['handoffs_4x_pages']:>11.1f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
