"""Test support for the model runner: tiny checkpoints and a minimal request driver.

The driver does what a scheduler does for the runner, without scheduling: it owns request
rows and KV pages, fills ``req_to_token`` for reused prefixes, and builds ForwardBatches.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def make_tiny_model(out: str, arch: str = "llama", *flags: str) -> str:
    """Run scripts/make_tiny_model.py in-process; returns the directory."""
    path = os.path.join(REPO_ROOT, "scripts", "make_tiny_model.py")
    spec = importlib.util.spec_from_file_location("make_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--arch", arch, "--out", out, *flags])


@dataclass
class Req:
    req_idx: int
    token_ids: list[int]  # prompt + generated
    kv_slots: list[int] = field(default_factory=list)  # slot of each position whose KV is in the pool
    owned_slots: list[int] = field(default_factory=list)  # whole pages this request allocated
    shared_prefix_len: int = 0  # leading kv_slots borrowed from another request


class Driver:
    def __init__(self, runner):
        self.runner = runner
        self.page_size = runner.page_size

    def new_req(self, prompt: list[int], reuse_from: Req | None = None, prefix_len: int = 0) -> Req:
        """A request; with ``reuse_from``, its first ``prefix_len`` tokens reuse that request's KV
        (a cache hit: ``req_to_token`` is written from the other request's slots)."""
        req = Req(self.runner.req_to_token_pool.alloc(1)[0], list(prompt))
        if reuse_from is not None and prefix_len:
            if reuse_from.token_ids[:prefix_len] != prompt[:prefix_len]:
                raise ValueError("reused prefix differs from the prompt")
            req.kv_slots = reuse_from.kv_slots[:prefix_len]
            req.shared_prefix_len = prefix_len
            self.runner.req_to_token_pool.write((req.req_idx, slice(0, prefix_len)), torch.tensor(req.kv_slots))
        return req

    def _take_slots(self, req: Req, n: int) -> list[int]:
        """Slots for the next ``n`` positions: fill the request's last page, then new pages."""
        free_in_page = len(req.owned_slots) - (len(req.kv_slots) - req.shared_prefix_len)
        if req.shared_prefix_len % self.page_size:
            raise ValueError("a reused prefix must be whole pages")
        need = max(0, n - free_in_page)
        pages = -(-need // self.page_size)
        if pages:
            loc = self.runner.token_to_kv_pool_allocator.alloc(pages * self.page_size)
            if loc is None:
                raise RuntimeError("KV pool exhausted")
            req.owned_slots += loc.tolist()
        start = len(req.kv_slots) - req.shared_prefix_len
        return req.owned_slots[start : start + n]

    def extend(self, reqs: list[Req], counts: list[int]):
        """Compute the next ``counts[i]`` not-yet-cached tokens of each request."""
        prefix_lens, inputs, loc = [], [], []
        for req, n in zip(reqs, counts):
            p = len(req.kv_slots)
            prefix_lens.append(p)
            inputs.append(req.token_ids[p : p + n])
            slots = self._take_slots(req, n)
            loc += slots
            req.kv_slots += slots
        batch = ForwardBatch.init_extend(self.runner, [r.req_idx for r in reqs], prefix_lens, inputs, torch.tensor(loc))
        return self.runner.forward(batch)

    def decode(self, reqs: list[Req]):
        loc = []
        for req in reqs:
            slots = self._take_slots(req, 1)
            loc += slots
            req.kv_slots += slots
        batch = ForwardBatch.init_decode(
            self.runner, [r.req_idx for r in reqs], [r.token_ids[-1] for r in reqs],
            [len(r.token_ids) for r in reqs], torch.tensor(loc),
        )
        return self.runner.forward(batch)

    def sample_greedy(self, reqs: list[Req], logits_output) -> list[tuple[int, float]]:
        params = [SamplingParams(temperature=0)] * len(reqs)
        info = SamplingBatchInfo.from_params(params, self.runner.model_config.vocab_size, self.runner.device)
        out = self.runner.sample(logits_output, info, return_logprob=True)
        for req, token in zip(reqs, out.next_token_ids):
            req.token_ids.append(token)
        return list(zip(out.next_token_ids, out.next_token_logprobs))

    def release(self, req: Req) -> None:
        self.runner.req_to_token_pool.free(req.req_idx)
        if req.owned_slots:
            self.runner.token_to_kv_pool_allocator.free(torch.tensor(req.owned_slots))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, batch: bool = True, chunk: int | None = None,
                 reuse: list[tuple[Req, int] | None] | None = None) -> list[list[tuple[int, float]]]:
        """Greedy (token, logprob) lists per prompt. ``batch``: all requests in every forward
        (else one request per forward); ``chunk``: prefill at most this many tokens per forward;
        ``reuse[i]``: (request, prefix_len) whose KV prompt i reuses."""
        reqs = [self.new_req(p, *(reuse[i] if reuse and reuse[i] else (None, 0))) for i, p in enumerate(prompts)]
        groups = [reqs] if batch else [[r] for r in reqs]
        results = [[] for _ in reqs]
        for group in groups:
            while True:
                todo = [r for r in group if len(r.token_ids) - len(r.kv_slots) > 0 and not results[reqs.index(r)]]
                if not todo:
                    break
                counts = [min(len(r.token_ids) - len(r.kv_slots), chunk or 1 << 30) for r in todo]
                out = self.extend(todo, counts)
                done = [i for i, r in enumerate(todo) if len(r.kv_slots) == len(r.token_ids)]
                sampled = self.sample_greedy([todo[i] for i in done], type(out)(out.next_token_logits[done]))
                for i, s in zip(done, sampled):
                    results[reqs.index(todo[i])].append(s)
            for _ in range(max_new_tokens - 1):
                out = self.decode(group)
                for r, s in zip(group, self.sample_greedy(group, out)):
                    results[reqs.index(r)].append(s)
        for r in reqs:
            self.release(r)
        return results


TP_WORKER = os.path.join(REPO_ROOT, "test", "registered", "unit", "model_executor", "tp_worker.py")


def run_tp_workers(models: list[str], prompts: list[list[int]], new_tokens: int, out_file: str, tp_size: int = 2,
                   timeout_s: float = 240) -> dict:
    """Run ``tp_worker.py`` on ``tp_size`` gloo ranks (one process each) over ``models``; returns
    what rank 0 wrote to ``out_file``: per model, the prefill logits and greedy outputs."""
    import json
    import subprocess
    import sys

    from sglang.test.multiprocess import free_port

    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(tp_size):
            cmd = [sys.executable, TP_WORKER, "--rank", str(rank), "--tp-size", str(tp_size), "--port", str(port),
                   "--models", *models, "--prompts", json.dumps(prompts), "--new-tokens", str(new_tokens),
                   "--out", out_file]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with open(out_file) as f:
        return json.load(f)
