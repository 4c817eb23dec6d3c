"""The flags of ``python -m sglang.bench_serving`` (upstream's names and defaults)."""

from __future__ import annotations

import argparse

from sglang.benchmark.datasets import DATASETS
from sglang.benchmark.request_funcs import ASYNC_REQUEST_FUNCS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark a running server: TTFT, ITL, E2E latency, throughput.")
    p.add_argument("--backend", default="sglang", choices=sorted(ASYNC_REQUEST_FUNCS))
    p.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:30000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dataset-name", default="random", choices=sorted(DATASETS))
    p.add_argument("--dataset-path", default="", help="local ShareGPT JSON (nothing is downloaded)")
    p.add_argument("--model", default=None, help="model name sent to the OpenAI routes (default: the server's)")
    p.add_argument("--tokenizer", default=None, help="local model directory with tokenizer.json "
                                                     "(default: the path the server reports)")
    p.add_argument("--num-prompts", "--num-prompt", type=_positive_int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--sharegpt-context-len", type=int, default=None)
    p.add_argument("--random-input-len", "--random-input", type=_positive_int, default=1024)
    p.add_argument("--random-output-len", "--random-output", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--output-file", default=None, help="append one JSON line with the results")
    p.add_argument("--output-details", action="store_true", help="per-request details in the JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the timed run")
    p.add_argument("--seed", type=int, default=1)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)
