"""A deterministic multi-turn workload for the e2e HiCache tests, and its comparison.

``clients`` conversations of ``rounds`` turns; each turn sends the whole history (earlier
prompts and answers) plus a new question, as token ids. Rounds run one after another; within
a round the clients run concurrently (threads), so batches mix load-backs, hits and misses.
The reference is a server whose device pool holds everything.
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
                    meta["cached_tokens_details"])

    with ThreadPoolExecutor(max_workers=clients if concurrent else 1) as pool:
        for r in range(rounds):
            turns += list(pool.map(lambda c: one(c, r), range(clients)))
    return turns


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
