"""Benchmark a running server (upstream's ``sglang.bench_serving`` CLI and helpers).

    python -m sglang.bench_serving --backend sglang --base-url http://127.0.0.1:30000 \\
        --dataset-name random --num-prompts 100 --random-input-len 256 --random-output-len 32 \\
        --request-rate 8 --max-concurrency 16 --output-file out.jsonl

Backends: ``sglang`` (native /generate, streaming), ``sglang-oai`` (/v1/completions),
``sglang-oai-chat`` (/v1/chat/completions). Prints TTFT / ITL / TPOT / E2E latency (mean,
median, p90, p99) and request / token throughput; ``--output-file`` appends one JSON line.
The module-level names are the helpers upstream's benchmark scripts import from here; the code
lives in ``sglang.benchmark``.
"""

from __future__ import annotations

import sys

from sglang.benchmark.cli import build_parser, parse_args
from sglang.benchmark.datasets import DATASETS, DatasetRow, get_dataset
from sglang.benchmark.datasets.random import sample_random_requests
from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests
from sglang.benchmark.metrics import BenchmarkMetrics, calculate_metrics
from sglang.benchmark.request_funcs import (
    ASYNC_REQUEST_FUNCS,
    RequestFuncInput,
    RequestFuncOutput,
    async_request_openai_chat_completions,
    async_request_openai_completions,
    async_request_sglang_generate,
)
from sglang.benchmark.serving import benchmark, get_request, run_benchmark
from sglang.benchmark.utils import (
    _create_bench_client_session,
    get_auth_headers,
    get_tokenizer,
    remove_prefix,
    remove_suffix,
)

__all__ = [
    "ASYNC_REQUEST_FUNCS", "DATASETS", "BenchmarkMetrics", "DatasetRow", "RequestFuncInput", "RequestFuncOutput",
    "_create_bench_client_session", "async_request_openai_chat_completions", "async_request_openai_completions",
    "async_request_sglang_generate", "benchmark", "build_parser", "calculate_metrics", "get_auth_headers",
    "get_dataset", "get_request", "get_tokenizer", "parse_args", "remove_prefix", "remove_suffix", "run_benchmark",
    "sample_random_requests", "sample_sharegpt_requests",
]


def main(argv=None) -> int:
    import requests

    args = parse_args(argv)
    try:
        record = run_benchmark(args)
    except (ValueError, requests.RequestException) as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    if record["completed"] == 0:
        print("bench_serving: every request failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
