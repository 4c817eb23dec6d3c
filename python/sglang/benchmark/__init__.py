"""Serving benchmarks against a running server (``python -m sglang.bench_serving``).

``utils``: the tokenizer and HTTP helpers; ``datasets``: request samplers (``DatasetRow``);
``request_funcs``: one async request function per backend; ``metrics``: the summary;
``serving``: the driver (rate, concurrency, warmup, report, JSONL); ``cli``: the flags.
Nothing here imports the engine: a benchmark runs beside any server.
"""
