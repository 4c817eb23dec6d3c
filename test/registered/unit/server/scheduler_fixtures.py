"""In-process scheduler driver for the storyline tests: feed messages at given steps, step until
idle, check integrity after every step, collect outputs per request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

MAX_STEPS = 5000


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    cached: dict | None = None


def make_scheduler(model_path: str, **kwargs) -> Scheduler:
    # Bit-identical logprobs across batch compositions hold with one OpenMP thread (with two,
    # decode rows differed by ~5e-7 here); test servers run with OMP_NUM_THREADS=1 as well.
    torch.set_num_threads(1)
    kwargs.setdefault("max_total_tokens", 4096)
    return Scheduler(ServerArgs(model_path=model_path, **kwargs))


def request(rid: str, ids: list[int], max_new: int = 8, **params) -> TokenizedGenerateReqInput:
    sp = SamplingParams(max_new_tokens=max_new, **{"temperature": 0, "ignore_eos": True, **params})
    return TokenizedGenerateReqInput(rid, list(ids), sp, return_logprob=True, seed=1234)


def prompts(n: int, length: int | tuple[int, int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = length if isinstance(length, int) else rng.randrange(*length)
        out.append(list(prefix or []) + [rng.randrange(3, 999) for _ in range(size)])
    return out


def drive(sched: Scheduler, schedule: dict[int, list], check: bool = True) -> dict[str, Result]:
    """``schedule``: step number -> messages handed to the scheduler before that step."""
    results: dict[str, Result] = {}
    step = 0
    while step <= max(schedule, default=0) or sched.has_work() or sched.transfers_in_flight():
        if step > MAX_STEPS:
            raise AssertionError(f"no progress after {MAX_STEPS} steps: {sched.waiting}, {sched.running}")
        sched.handle_messages(schedule.get(step, []))
        for out in sched.step():
            r = results.setdefault(out.rid, Result())
            r.tokens += out.token_ids
            r.logprobs += out.logprobs or []
            if out.finish is not None:
                r.finish, r.cached = out.finish, out.cached_tokens
        if check:
            sched.check_integrity()
        sched.on_idle()
        step += 1
    return results


def run_each(sched: Scheduler, reqs: list[TokenizedGenerateReqInput]) -> dict[str, Result]:
    """One request at a time."""
    out = {}
    for r in reqs:
        out.update(drive(sched, {0: [r]}))
    return out


def abort(rid: str) -> AbortReq:
    return AbortReq(rid)
