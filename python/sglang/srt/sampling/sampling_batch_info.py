"""Sampling parameters of a batch as tensors, plus the per-request noise keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    """One row per request, in batch order.

    ``seeds[i]`` and ``steps[i]`` (tokens the request has generated so far) key the random
    noise of row ``i``: the same key gives the same noise on every device, TP rank and batch.
    The caller supplies a seed for requests without ``sampling_seed`` (it must be the same on
    every TP rank, e.g. drawn once by the scheduler and broadcast with the request).
    """

    temperatures: torch.Tensor  # (bs, 1) fp32; 1.0 on greedy rows
    top_ps: torch.Tensor  # (bs,) fp32
    top_ks: torch.Tensor  # (bs,) int64; vocab size where disabled
    min_ps: torch.Tensor  # (bs,) fp32
    is_greedy: list[bool]
    seeds: list[int]
    steps: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.is_greedy)

    @property
    def is_all_greedy(self) -> bool:
        return all(self.is_greedy)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        device: str | torch.device,
        seeds: list[int] | None = None,
        steps: list[int] | None = None,
    ) -> "SamplingBatchInfo":
        """``seeds`` default to each request's ``sampling_seed`` (0 when unset); ``steps`` to 0."""
        n = len(params)
        seeds = [p.sampling_seed or 0 for p in params] if seeds is None else list(seeds)
        steps = [0] * n if steps is None else list(steps)
        if len(seeds) != n or len(steps) != n:
            raise ValueError(f"seeds ({len(seeds)}) and steps ({len(steps)}) must have one entry per request ({n})")
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            is_greedy=greedy,
            seeds=seeds,
            steps=steps,
        )
