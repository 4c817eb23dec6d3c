"""Machine instructions per scheduler step, HiCache off and on, counted by valgrind (callgrind).

Wall time of a ~0.6 ms step on a shared 2-core VM moves by +-5% from one process to the next,
as much as what HiCache adds to it, so a change to the control plane can be neither confirmed
nor ruled out by timing alone. An instruction count is deterministic: the same code and
workload give the same count to about two parts in ten thousand. It is a proxy (it does not see
cache misses or branch mispredictions: add ``--cache-sim`` for callgrind's model of them), so
read it beside ``bench_scheduler_overhead.py``, never instead of it.

The workload is ``bench_scheduler_overhead.py``'s (same prompts, null forward, null copies):
``--warmup`` steps run uncounted, then ``--steps`` steps are counted; only instructions inside
the counted region are collected (``--toggle-collect`` on a C function the region runs in).
Under valgrind a copy job runs ~50x slower, which would send every short copy job to the lane's
worker thread instead of running it in the step (see ``transfer_lane.INLINE_MAX_S``); the
child therefore keeps the inline path that a native run takes.

    python scripts/bench/bench_step_instructions.py [--waiting 8] [--prompt-len 1024] [--steps 200]

Needs ``valgrind`` on PATH (``apt-get install valgrind``). Each mode takes about a minute at
8 x 1k; the two run in parallel.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

from sglang.test.engine_utils import make_tiny_model  # noqa: E402

REGION = "functools_reduce"  # the C function the counted steps run inside (see child())


def child(args) -> None:
    import torch

    import bench_scheduler_overhead as b
    from sglang.srt.mem_cache.controller import transfer_lane

    torch.set_num_threads(1)
    transfer_lane.INLINE_MAX_S = 1.0  # valgrind slows jobs ~50x: keep the path a native run takes
    opts = argparse.Namespace(page_size=16, groups=4, shared=0.75, max_new=4, pool_requests=4,
                              hicache_ratio=args.hicache_ratio, chunked_prefill_size=2048, max_running=64,
                              policy="fcfs", null_copies=True)
    sched = b.Scheduler(b.server_args(args.model_dir, args.prompt_len, args.child == "on", opts))
    sched.runner.forward = b.null_forward(sched.runner)
    if args.child == "on":
        b.null_copies(sched.tree_cache)
    work = b.Workload(args.prompt_len, opts.groups, opts.shared, opts.page_size, opts.max_new)

    def run(steps: int) -> None:
        for _ in range(steps):
            sched.handle_messages([work.next() for _ in range(args.waiting - len(sched.waiting))])
            sched.step()

    run(args.warmup)
    functools.reduce(lambda _a, _b: run(args.steps), [0, 0])  # the counted region
    sched.shutdown()


def count(mode: str, args, tmp: str) -> int:
    out = Path(tmp) / f"callgrind.{mode}"
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={REGION}",
           f"--callgrind-out-file={out}"]
    if args.cache_sim:
        cmd += ["--cache-sim=yes", "--branch-sim=yes"]
    cmd += [sys.executable, __file__, "--child", mode, "--model-dir", str(Path(tmp) / "model"),
            "--waiting", str(args.waiting), "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--hicache-ratio", str(args.hicache_ratio)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"valgrind run ({mode}) failed, exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return int(m.group(1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200, help="counted steps")
    p.add_argument("--warmup", type=int, default=30, help="steps run before counting")
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--cache-sim", action="store_true", help="also simulate caches and branch prediction (slower)")
    p.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found on PATH (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(str(Path(tmp) / "model"), "qwen3", "--max-pos", str(args.prompt_len + 40))  # both modes' model
        with ThreadPoolExecutor(2) as pool:
            off, on = pool.map(lambda m: count(m, args, tmp), ("off", "on"))
    per_off, per_on = off / args.steps, on / args.steps
    print(f"{args.waiting} waiting x {args.prompt_len} tokens, {args.steps} steps counted")
    print(f"instructions per step: off {per_off:,.0f}  on {per_on:,.0f}  on-off {per_on - per_off:,.0f}  "
          f"on/off {per_on / per_off:.4f}")
    return {"off": per_off, "on": per_on}


if __name__ == "__main__":
    main()
