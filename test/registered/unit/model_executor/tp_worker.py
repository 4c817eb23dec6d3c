"""One TP rank for test_tensor_parallel.py: runs the fixed prompts on each model directory
and (rank 0) writes greedy tokens, logprobs and first-step logits as JSON."""

import argparse
import json
import sys

import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.engine_utils import Driver


def run_model(runner, prompts, new_tokens):
    driver = Driver(runner)
    reqs = [driver.new_req(p) for p in prompts]
    logits = driver.extend(reqs, [len(p) for p in prompts]).next_token_logits
    for r in reqs:
        driver.release(r)
    return {"logits": logits.tolist(), "outputs": driver.generate(prompts, new_tokens)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token lists")
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    runner = None
    for path in args.models:
        config = ModelRunnerConfig(
            path, tp_size=args.tp_size, tp_rank=args.rank, dist_init_method=f"tcp://127.0.0.1:{args.port}",
            max_total_tokens=4096, max_running_requests=8,
        )
        runner = ModelRunner(config)
        results[path] = run_model(runner, json.loads(args.prompts), args.new_tokens)
    runner.shutdown()
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    sys.exit(main())
