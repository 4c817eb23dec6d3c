"""Pick next tokens from logits: greedy, or temperature / top-k / top-p / min-p sampling.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly
from p. E comes from a CPU generator keyed by each row's (seed, step), so a request's tokens
are a function of its own logits and key only: the same on CPU and CUDA, on every TP rank and
in any batch. Logprobs are those of the unmodified distribution (log_softmax of the raw logits,
temperature 1, no truncation).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SamplerOutput:
    """Per request, in batch order: ``next_token_ids``; with logprobs requested,
    ``next_token_logprobs`` and ``top_logprobs`` (lists of (token_id, logprob), best first)."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def noise_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed derived from (request seed, decode step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def exponential_noise(seed: int, step: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(noise_seed(seed, step))
    uniform = torch.rand(vocab_size, generator=gen, dtype=torch.float32)
    return -torch.log(uniform)  # in (0, inf]; rand never returns 1


def truncated_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Softmax of logits / temperature with top-k, top-p and min-p applied (masked to 0)."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < info.top_ks.unsqueeze(1)) & (before < info.top_ps.unsqueeze(1))
    keep &= sorted_probs >= info.min_ps.unsqueeze(1) * sorted_probs[:, :1]
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SamplerOutput:
        """``logits``: (bs, vocab) fp32. Returns tokens (and logprobs) as Python lists."""
        if logits.shape[0] != info.batch_size:
            raise ValueError(f"logits have {logits.shape[0]} rows but sampling info has {info.batch_size}")
        next_ids = logits.argmax(dim=-1)
        if not info.is_all_greedy:
            next_ids = torch.where(torch.tensor(info.is_greedy, device=logits.device), next_ids, self._sample(logits, info))
        out = SamplerOutput(next_token_ids=next_ids.tolist())
        if return_logprob or top_logprobs_nums:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.next_token_logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
            out.top_logprobs = self._top_logprobs(logprobs, top_logprobs_nums or [0] * logits.shape[0])
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = truncated_probs(logits, info)
        noise = torch.stack([exponential_noise(s, t, logits.shape[-1]) for s, t in zip(info.seeds, info.steps)])
        return (probs / noise.to(probs.device)).argmax(dim=-1)

    @staticmethod
    def _top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> list[list[tuple[int, float]]]:
        result = []
        for row, num in zip(logprobs, nums):
            if num <= 0:
                result.append([])
                continue
            values, ids = row.topk(min(num, row.numel()))
            result.append(list(zip(ids.tolist(), values.tolist())))
        return result
