"""The benchmark summary: throughput and TTFT / ITL / TPOT / E2E latency statistics (ms)."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import numpy as np

LATENCIES = ("ttft", "itl", "tpot", "e2e_latency")
STATS = ("mean", "median", "std", "p90", "p99")


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float
    total_throughput: float
    concurrency: float  # mean requests in flight
    latency_ms: dict  # "{stat}_{latency}_ms" -> value, e.g. "p99_ttft_ms"

    def flat(self) -> dict:
        out = asdict(self)
        out.update(out.pop("latency_ms"))
        return out


def _stats(values_s: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def calculate_metrics(input_requests, outputs, dur_s: float, tokenizer, backend: str = "") -> tuple[BenchmarkMetrics,
                                                                                                    list[int]]:
    """Metrics over the successful ``outputs`` (aligned with ``input_requests``) of a run that
    took ``dur_s`` seconds; also each request's output length (0 for a failure)."""
    ok = [(row, out) for row, out in zip(input_requests, outputs) if out.success]
    output_lens = [out.output_len if out.success else 0 for out in outputs]
    series = {name: [] for name in LATENCIES}
    retokenized = 0
    for _, out in ok:
        series["ttft"].append(out.ttft)
        series["itl"].extend(out.itl)
        series["e2e_latency"].append(out.latency)
        if out.output_len > 1:
            series["tpot"].append((out.latency - out.ttft) / (out.output_len - 1))
        retokenized += len(tokenizer.encode(out.generated_text, add_special_tokens=False)) if tokenizer else 0
    if not ok:
        warnings.warn("every request failed; check the benchmark arguments and the server log", stacklevel=2)
    total_input = sum(out.prompt_len or row.prompt_len for row, out in ok)
    total_output = sum(output_lens)
    latency_ms = {f"{stat}_{name}_ms": value for name in LATENCIES for stat, value in _stats(series[name]).items()}
    dur = max(dur_s, 1e-9)
    metrics = BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        total_output_retokenized=retokenized, request_throughput=len(ok) / dur, input_throughput=total_input / dur,
        output_throughput=total_output / dur, total_throughput=(total_input + total_output) / dur,
        concurrency=sum(series["e2e_latency"]) / dur, latency_ms=latency_ms,
    )
    return metrics, output_lens


def format_report(metrics: BenchmarkMetrics, backend: str, request_rate: float, max_concurrency, dur_s: float) -> str:
    """The human-readable summary printed after a run."""
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             row("Backend:", backend), row("Traffic request rate:", request_rate),
             row("Max request concurrency:", max_concurrency or "not set"),
             row("Successful requests:", metrics.completed), row("Failed requests:", metrics.failed),
             num("Benchmark duration (s):", dur_s), row("Total input tokens:", metrics.total_input),
             row("Total generated tokens:", metrics.total_output),
             num("Request throughput (req/s):", metrics.request_throughput),
             num("Input token throughput (tok/s):", metrics.input_throughput),
             num("Output token throughput (tok/s):", metrics.output_throughput),
             num("Total token throughput (tok/s):", metrics.total_throughput),
             num("Concurrency:", metrics.concurrency)]
    titles = {"e2e_latency": ("End-to-End Latency", "E2E Latency"), "ttft": ("Time to First Token", "TTFT"),
              "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"), "itl": ("Inter-Token Latency", "ITL")}
    for name in ("e2e_latency", "ttft", "tpot", "itl"):
        title, short = titles[name]
        lines.append("{:-^50}".format(title))
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(num(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {short} (ms):",
                             metrics.latency_ms[f"{stat}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
