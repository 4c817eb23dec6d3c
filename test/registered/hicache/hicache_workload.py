"""A deterministic multi-turn workload for the e2e HiCache tests, and its comparison.

``clients`` conversations of ``rounds`` turns; each turn sends the whole history (earlier
prompts and answers) plus a new question, as token ids. Rounds run one after another; within
a round the clients run concurrently (threads), so batches mix load-backs, hits and misses.
The reference is a server whose device pool holds everything. ``run_open_loop`` runs the same
conversations open loop: each client sends its next turn after a seeded exponential gap.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Turn:
    client: int
    round: int
    output_ids: list[int]
    logprobs: list[float]
    cached: dict
    prompt: list[int] | None = None  # the ids sent: history + the new question


def run_workload(server, clients: int = 4, rounds: int = 3, system_len: int = 48, question_len: int = 40,
                 max_new: int = 8, seed: int = 0, concurrent: bool = True) -> list[Turn]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 999) for _ in range(system_len)]  # shared by every client
    history = [list(system) for _ in range(clients)]
    questions = [[[rng.randrange(3, 999) for _ in range(question_len)] for _ in range(clients)]
                 for _ in range(rounds)]
    turns: list[Turn] = []

    def one(c: int, r: int) -> Turn:
        prompt = history[c] + questions[r][c]
        out = server.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, **GREEDY},
                              return_logprob=True)
        meta = out["meta_info"]
        history[c] = prompt + out["output_ids"]
        return Turn(c, r, out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
                    meta["cached_tokens_details"], prompt)

    with ThreadPoolExecutor(max_workers=clients if concurrent else 1) as pool:
        for r in range(rounds):
            turns += list(pool.map(lambda c: one(c, r), range(clients)))
    return turns


def run_open_loop(server, clients: int = 4, rounds: int = 3, system_len: int = 48, question_len: int = 40,
                  max_new: int = 8, seed: int = 0, rate_per_client: float = 20.0) -> list[Turn]:
    """The conversations of ``run_workload`` (same seed: same prompts), but every client runs on
    its own, waiting an exponential gap (mean 1 / ``rate_per_client`` s) before each turn, so
    turns of different rounds overlap. Returns the turns ordered like ``run_workload``'s."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 999) for _ in range(system_len)]
    questions = [[[rng.randrange(3, 999) for _ in range(question_len)] for _ in range(clients)]
                 for _ in range(rounds)]
    gaps = random.Random(seed + 1)
    waits = [[gaps.expovariate(rate_per_client) for _ in range(rounds)] for _ in range(clients)]

    def conversation(c: int) -> list[Turn]:
        history, turns = list(system), []
        for r in range(rounds):
            time.sleep(waits[c][r])
            prompt = history + questions[r][c]
            out = server.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, **GREEDY},
                                  return_logprob=True)
            meta = out["meta_info"]
            history = prompt + out["output_ids"]
            turns.append(Turn(c, r, out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
                              meta["cached_tokens_details"], prompt))
        return turns

    with ThreadPoolExecutor(max_workers=clients) as pool:
        per_client = list(pool.map(conversation, range(clients)))
    return [per_client[c][r] for r in range(rounds) for c in range(clients)]


def assert_same_tokens(ref: list[Turn], got: list[Turn], logprob_tol: float = 0.0) -> None:
    for a, b in zip(ref, got, strict=True):
        assert (a.client, a.round) == (b.client, b.round)
        assert a.output_ids == b.output_ids, f"client {a.client} round {a.round}: {a.output_ids} != {b.output_ids}"
        worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        assert worst <= logprob_tol, f"client {a.client} round {a.round}: logprob diff {worst} > {logprob_tol}"


def tier_totals(turns: list[Turn]) -> dict[str, int]:
    out = {"device": 0, "host": 0, "storage": 0}
    for t in turns:
        for k, v in t.cached.items():
            out[k] += v
    return out


def server_counters(server) -> dict:
    return server.get("/get_server_info").json()["scheduler"]["counters"]


def wait_idle_check(server, timeout: float = 30) -> dict:
    """Counters once the server has run its idle integrity check (transfers drained)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = server_counters(server)
        if counters["num_idle_checks"] > 0 or time.monotonic() > deadline:
            return counters
        time.sleep(0.1)
