"""Multi-turn chat benchmark against a running server, after sglang's HiCache multi-turn bench.

    python scripts/bench/bench_multiturn.py --url http://127.0.0.1:30000 \\
        --num-clients 8 --num-rounds 6 --request-length 256 --output-length 16 \\
        [--system-prompt-length 600] [--request-rate 2.0] [--round-barrier] \\
        [--noisy-neighbours 4] [--json FILE]

N clients hold one conversation each. Every conversation starts with the same
``--system-prompt-length`` token ids; in round r a client sends its whole history (earlier
prompts and answers) plus a new question of ``--request-length`` token ids
(``--sub-question-input-length`` after the first round, when set), streamed from
``/generate``. Requests leave as a Poisson process of ``--request-rate`` per second (inf: as
soon as a client is ready); with ``--round-barrier`` no client starts round r+1 before every
client finished round r (the closed-loop case: with ``--request-rate inf`` each round's
requests leave at once). ``--noisy-neighbours N`` runs N neighbour processes (CPU-bound and
file-I/O, alternating; ``noisy_neighbours.py``) for the duration of the run. Reports TTFT and inter-token latency percentiles, input/output
throughput, and the cache hit rate (cached prompt tokens / prompt tokens) overall, per round
and per tier. ``reusable_fraction`` is the hit rate of an ideal prefix cache of this engine:
every earlier token of the conversation whose KV was computed (all but the last answer token),
in whole pages, leaving the prompt's last token to compute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from noisy_neighbours import NoisyNeighbours  # noqa: E402

TIERS = ("device", "host", "storage")


@dataclass
class Record:
    client: int
    round: int
    prompt_tokens: int
    reusable_tokens: int
    completion_tokens: int = 0
    cached: dict = field(default_factory=dict)
    ttft: float = 0.0
    itls: list = field(default_factory=list)
    latency: float = 0.0
    output_ids: list = field(default_factory=list)


class PoissonGate:
    """Send times of a Poisson process (``rate`` per second; inf: no waiting)."""

    def __init__(self, rate: float, rng: random.Random):
        self.rate, self.rng = rate, rng
        self.next = time.perf_counter()
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        if self.rate == float("inf"):
            return
        async with self.lock:
            at = max(time.perf_counter(), self.next)
            self.next = at + self.rng.expovariate(self.rate)
        await asyncio.sleep(max(at - time.perf_counter(), 0))


async def stream_generate(session, url: str, input_ids: list[int], output_len: int, rec: Record) -> list[int]:
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    start = last = time.perf_counter()
    final, seen = None, 0
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate -> {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            now, new = time.perf_counter(), len(chunk["output_ids"]) - seen
            if seen == 0:
                rec.ttft = now - start
            elif new > 0:
                rec.itls += [(now - last) / new] * new
            last, seen, final = now, len(chunk["output_ids"]), chunk
    rec.latency = time.perf_counter() - start
    meta = final["meta_info"]
    rec.completion_tokens = meta["completion_tokens"]
    rec.cached = dict(meta["cached_tokens_details"])
    return final["output_ids"]


def reusable(history_len: int, prompt_len: int, page_size: int) -> int:
    if history_len <= 0:
        return 0
    return min(history_len - 1, prompt_len - 1) // page_size * page_size


async def run_clients(args, info: dict) -> tuple[list[Record], float]:
    import aiohttp

    rng = random.Random(args.seed)
    vocab, page = info["vocab_size"], info["page_size"]
    system = [rng.randrange(3, vocab) for _ in range(args.system_prompt_length)]
    follow_up = args.sub_question_input_length or args.request_length
    questions = [[[rng.randrange(3, vocab) for _ in range(args.request_length if r == 0 else follow_up)]
                  for r in range(args.num_rounds)] for _ in range(args.num_clients)]
    gate = PoissonGate(args.request_rate, random.Random(args.seed + 1))
    barrier = asyncio.Barrier(args.num_clients) if args.round_barrier else None
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)

    async def client(c: int, session) -> None:
        history: list[int] = list(system)
        for r in range(args.num_rounds):
            if barrier is not None:
                await barrier.wait()
            prompt = history + questions[c][r]
            rec = Record(c, r, len(prompt), reusable(len(history), len(prompt), page))
            await gate.wait()
            output = await stream_generate(session, args.url, prompt, args.output_length, rec)
            rec.output_ids = output
            records.append(rec)
            history = prompt + output

    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(c, session) for c in range(args.num_clients)))
        wall = time.perf_counter() - start
    return records, wall


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(records: list[Record], wall: float) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    cached = {t: sum(r.cached.get(t, 0) for r in records) for t in TIERS}
    ttfts = [r.ttft for r in records]
    itls = [x for r in records for x in r.itls]
    rounds = sorted({r.round for r in records})
    per_round = {}
    for n in rounds:
        rs = [r for r in records if r.round == n]
        p = sum(r.prompt_tokens for r in rs)
        per_round[n] = {"hit_rate": sum(sum(r.cached.values()) for r in rs) / p, "prompt_tokens": p,
                        "ttft_p50": pct([r.ttft for r in rs], 50)}
    return {
        "num_requests": len(records), "wall_s": wall,
        "ttft_p50": pct(ttfts, 50), "ttft_p90": pct(ttfts, 90), "ttft_p99": pct(ttfts, 99),
        "itl_p50": pct(itls, 50), "itl_p90": pct(itls, 90), "itl_p99": pct(itls, 99),
        "itl_mean": statistics.fmean(itls) if itls else 0.0,
        "input_throughput": prompt / wall, "output_throughput": sum(r.completion_tokens for r in records) / wall,
        "hit_rate": sum(cached.values()) / prompt,
        "hit_rate_by_tier": {t: cached[t] / prompt for t in TIERS},
        "hit_rate_by_round": {str(k): v["hit_rate"] for k, v in per_round.items()},
        "ttft_p50_by_round": {str(k): v["ttft_p50"] for k, v in per_round.items()},
        "reusable_fraction": sum(r.reusable_tokens for r in records) / prompt,
        "prompt_tokens": prompt, "cached_tokens": cached,
    }


def print_report(name: str, s: dict) -> None:
    noisy = f", {s['noisy_neighbours']} noisy neighbours" if s.get("noisy_neighbours") else ""
    print(f"== {name}: {s['num_requests']} requests in {s['wall_s']:.1f} s{noisy}")
    print(f"  TTFT  p50 {s['ttft_p50']:.3f}  p90 {s['ttft_p90']:.3f}  p99 {s['ttft_p99']:.3f} s")
    print(f"  ITL   p50 {s['itl_p50'] * 1e3:.1f}  p90 {s['itl_p90'] * 1e3:.1f}  p99 {s['itl_p99'] * 1e3:.1f} ms")
    print(f"  throughput  input {s['input_throughput']:.0f} tok/s  output {s['output_throughput']:.1f} tok/s")
    tiers = "  ".join(f"{t} {v:.3f}" for t, v in s["hit_rate_by_tier"].items())
    print(f"  hit rate {s['hit_rate']:.3f} (reusable {s['reusable_fraction']:.3f}; {tiers})")
    rounds = "  ".join(f"r{k}:{v:.2f}" for k, v in s["hit_rate_by_round"].items())
    print(f"  hit rate by round  {rounds}")
    ttft = "  ".join(f"r{k}:{v:.2f}" for k, v in s["ttft_p50_by_round"].items())
    print(f"  TTFT p50 by round  {ttft}")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-clients", type=int, default=8)
    parser.add_argument("--num-rounds", type=int, default=6)
    parser.add_argument("--system-prompt-length", type=int, default=0, help="tokens every conversation starts with")
    parser.add_argument("--request-length", type=int, default=256, help="new question tokens per round")
    parser.add_argument("--sub-question-input-length", type=int, default=0,
                        help="question tokens of rounds after the first (0: --request-length), as upstream's "
                             "bench_multiturn.py: a long first prompt followed by short follow-ups")
    parser.add_argument("--output-length", type=int, default=16, help="answer tokens per round")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (requests/s)")
    parser.add_argument("--round-barrier", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout (s)")
    parser.add_argument("--noisy-neighbours", type=int, default=0,
                        help="neighbour processes (CPU-bound and file-I/O, alternating) during the run")


def bench(url: str, args) -> dict:
    import requests

    args.url = url
    info = requests.get(url + "/get_server_info", timeout=30).json()
    admin_key = getattr(args, "admin_api_key", None) or os.environ.get("SGLANG_ADMIN_API_KEY")
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    requests.post(url + "/flush_cache", headers=headers, timeout=30).raise_for_status()  # an admin route
    with NoisyNeighbours(getattr(args, "noisy_neighbours", 0)):
        records, wall = asyncio.run(run_clients(args, info))
    summary = summarize(records, wall)
    summary["noisy_neighbours"] = getattr(args, "noisy_neighbours", 0)
    summary["outputs"] = {f"{r.client}/{r.round}": r.output_ids for r in records}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--json", help="write the summary to this file")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    summary = bench(args.url, args)
    print_report(args.url, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
