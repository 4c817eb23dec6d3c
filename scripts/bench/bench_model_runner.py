"""Forward latency of the ModelRunner: prefill of N tokens, and decode steps at batch sizes.

    python scripts/bench/bench_model_runner.py                      # default tiny model
    python scripts/bench/bench_model_runner.py --hidden 512 --layers 8 --heads 8 --kv-heads 4 \\
        --intermediate 1536 --vocab 4000                            # prefill-dominated size

Builds the model with scripts/make_tiny_model.py into a temporary directory (or uses
--model-path) and prints median milliseconds per forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig  # noqa: E402
from sglang.test.engine_utils import Driver, make_tiny_model  # noqa: E402


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench(runner, prefill_lens, decode_batches, context, repeats):
    driver = Driver(runner)
    vocab = runner.model_config.vocab_size
    for n in prefill_lens:
        prompt = torch.randint(5, vocab, (n,)).tolist()

        def prefill():
            req = driver.new_req(prompt)
            driver.extend([req], [n])
            driver.release(req)

        prefill()  # warm-up
        print(f"prefill {n:5d} tokens: {timed(prefill, repeats):8.1f} ms")
    for bs in decode_batches:
        reqs = [driver.new_req(torch.randint(5, vocab, (context,)).tolist()) for _ in range(bs)]
        driver.extend(reqs, [context] * bs)
        for r in reqs:
            r.token_ids.append(7)

        def step():
            driver.decode(reqs)
            for r in reqs:
                r.token_ids.append(7)

        step()
        print(f"decode bs={bs:3d} ctx={context}: {timed(step, repeats):8.1f} ms/step")
        for r in reqs:
            driver.release(r)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args, model_flags = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or make_tiny_model(os.path.join(tmp, "m"), args.arch, *model_flags)
        tokens = max(max(args.prefill), max(args.decode_batch) * (args.context + args.repeats + 2)) + 64
        runner = ModelRunner(ModelRunnerConfig(path, device=args.device, max_total_tokens=tokens,
                                               max_running_requests=max(args.decode_batch)))
        print(f"torch threads: {torch.get_num_threads()}, device: {args.device}")
        bench(runner, args.prefill, args.decode_batch, args.context, args.repeats)


if __name__ == "__main__":
    main()
