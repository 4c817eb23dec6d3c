"""The serving benchmark driver: send the sampled requests at ``request_rate`` (Poisson
arrivals; ``inf`` sends them all at once) with at most ``max_concurrency`` in flight, then
report and optionally append the result to a JSONL file."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import numpy as np
import requests

from sglang.benchmark.datasets import DatasetRow, get_dataset
from sglang.benchmark.metrics import calculate_metrics, format_report
from sglang.benchmark.request_funcs import ASYNC_REQUEST_FUNCS, BACKEND_ROUTES, RequestFuncInput
from sglang.benchmark.utils import get_auth_headers, get_tokenizer

logger = logging.getLogger(__name__)

WARMUP_OUTPUT_TOKENS = 32


async def get_request(input_requests: list[DatasetRow], request_rate: float):
    """Yield the requests in order, waiting exponential gaps of mean 1 / ``request_rate`` s."""
    for request in input_requests:
        yield request
        if request_rate != float("inf"):
            await asyncio.sleep(float(np.random.exponential(1.0 / request_rate)))


def _progress(total: int, disable: bool):
    if disable:
        return None
    try:
        from tqdm.asyncio import tqdm
    except ImportError:
        return None
    return tqdm(total=total)


async def benchmark(backend: str, api_url: str, base_url: str, model_id: str, tokenizer,
                    input_requests: list[DatasetRow], request_rate: float, max_concurrency: int | None,
                    disable_tqdm: bool = True, extra_request_body: dict | None = None, warmup_requests: int = 1,
                    stream: bool = True, ignore_eos: bool = True, flush_cache: bool = False) -> dict:
    """Run one benchmark; returns the metrics (flat dict) plus per-request details.
    ValueError when the backend is unknown or every warmup request failed."""
    try:
        request_func = ASYNC_REQUEST_FUNCS[backend]
    except KeyError:
        raise ValueError(f"--backend {backend!r} is not known; choose one of: {', '.join(ASYNC_REQUEST_FUNCS)}") \
            from None
    extra = dict(extra_request_body or {})

    def make_input(row: DatasetRow, output_len: int) -> RequestFuncInput:
        return RequestFuncInput(prompt=row.prompt, api_url=api_url, prompt_len=row.prompt_len, output_len=output_len,
                                model=model_id, image_data=row.image_data,
                                extra_request_body={**extra, **row.extra_request_body}, stream=stream,
                                ignore_eos=ignore_eos)

    if warmup_requests > 0 and input_requests:
        warm = make_input(input_requests[0], min(input_requests[0].output_len, WARMUP_OUTPUT_TOKENS))
        outs = await asyncio.gather(*[request_func(warm) for _ in range(warmup_requests)])
        if not any(o.success for o in outs):
            raise ValueError(f"warmup failed; check the benchmark arguments. Error: {outs[0].error}")
        print(f"Warmup completed with {warmup_requests} requests. Starting main benchmark run...")
    if flush_cache:
        requests.post(base_url + "/flush_cache", headers=get_auth_headers(), timeout=60)

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = _progress(len(input_requests), disable_tqdm)

    async def limited(func_input):
        if semaphore is None:
            return await request_func(func_input, pbar)
        async with semaphore:
            return await request_func(func_input, pbar)

    start = time.perf_counter()
    tasks = []
    async for row in get_request(input_requests, request_rate):
        tasks.append(asyncio.create_task(limited(make_input(row, row.output_len))))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()

    metrics, output_lens = calculate_metrics(input_requests, outputs, duration, tokenizer, backend)
    print(format_report(metrics, backend, request_rate, max_concurrency, duration))
    errors = sorted({o.error for o in outputs if not o.success})
    if errors:
        print(f"{metrics.failed} requests failed; first error: {errors[0][:300]}")
    return {"duration": duration, **metrics.flat(),
            "details": {"input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
                        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
                        "generated_texts": [o.generated_text for o in outputs],
                        "errors": [o.error for o in outputs]}}


def _base_url(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    return f"http://{args.host}:{args.port}"


def _served_model(base_url: str) -> tuple[str, str | None]:
    """(model id, local tokenizer path) the server (or a router in front of it) reports:
    ``/get_model_info`` when served, else ``/v1/models``."""
    resp = requests.get(base_url + "/get_model_info", headers=get_auth_headers(), timeout=30)
    if resp.status_code == 200:
        info = resp.json()
        return info.get("served_model_name") or info["model_path"], info.get("tokenizer_path") or info["model_path"]
    resp = requests.get(base_url + "/v1/models", headers=get_auth_headers(), timeout=30)
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return card["id"], card.get("root")


def result_record(args, result: dict) -> dict:
    """The JSONL line: the run's arguments and its metrics (details only with --output-details)."""
    record = {"backend": args.backend, "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
              "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
              "random_range_ratio": args.random_range_ratio, "sharegpt_output_len": args.sharegpt_output_len,
              **{k: v for k, v in result.items() if k != "details"}}
    record["total_input_tokens"], record["total_output_tokens"] = record["total_input"], record["total_output"]
    record["total_output_tokens_retokenized"] = record["total_output_retokenized"]
    if args.output_details:
        record.update(result["details"])
    return record


def run_benchmark(args) -> dict:
    """Resolve the server, model, tokenizer and dataset from ``args``, run, report; appends
    one JSON line to ``args.output_file`` when set. Returns the JSONL record."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    base_url = _base_url(args)
    model_id, served_path = args.model, None
    if model_id is None or args.tokenizer is None:
        served_id, served_path = _served_model(base_url)
        model_id = model_id or served_id
    tokenizer = get_tokenizer(args.tokenizer or served_path or model_id)
    func = ASYNC_REQUEST_FUNCS.get(args.backend)
    if func is None:
        raise ValueError(f"--backend {args.backend!r} is not known; choose one of: {', '.join(ASYNC_REQUEST_FUNCS)}")
    input_requests = get_dataset(args, tokenizer)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    result = asyncio.run(benchmark(
        backend=args.backend, api_url=base_url + BACKEND_ROUTES[func], base_url=base_url, model_id=model_id,
        tokenizer=tokenizer, input_requests=input_requests, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, disable_tqdm=args.disable_tqdm, extra_request_body=extra,
        warmup_requests=args.warmup_requests, stream=not args.disable_stream, ignore_eos=not args.disable_ignore_eos,
        flush_cache=args.flush_cache))
    record = result_record(args, result)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record
