"""Routed mixture of experts with a sigmoid, bias-corrected, group-limited top-k router.

The router of DeepSeek-V3 and MiMo-V2-Flash (no shared experts here): scores are
``sigmoid(x @ gate.T)`` in fp32; experts are chosen by ``scores + e_score_correction_bias``,
first ``topk_group`` of ``n_group`` groups (ranked by the sum of their two best experts), then
``top_k`` experts inside them; the weights are the chosen experts' uncorrected scores, divided
by their sum when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.

Experts are a plain loop over the experts some token chose: each runs its gated MLP on its
tokens with the batch-invariant linear (``invariant_linear`` pads to ``MIN_GEMM_ROWS`` rows), and
every token sums its experts' weighted outputs in ascending expert order, as HF does, so a
token's output does not depend on which other tokens share the batch. Under tensor parallelism
every expert's intermediate dimension is sharded (gate_up column-, down row-parallel) and the
partial sums are all-reduced once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear, invariant_linear


def lane_invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``x.sigmoid()`` whose every element takes the vectorized path: the last ``numel % vector
    width`` elements of a contiguous tensor go through a scalar tail loop that rounds differently,
    and ``numel`` follows the token count. Padding to a multiple of 64 leaves no tail."""
    flat = x.reshape(-1)
    return F.pad(flat, (0, -flat.numel() % 64)).sigmoid()[: flat.numel()].view(x.shape)


def grouped_topk_sigmoid(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 (T, top_k), expert ids (T, top_k)) from fp32 ``router_logits`` (T, E)."""
    num_tokens, num_experts = router_logits.shape
    scores = lane_invariant_sigmoid(router_logits)
    choice = scores + correction_bias.float()
    group_scores = choice.view(num_tokens, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // n_group).reshape(num_tokens, num_experts)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class MoEGate(nn.Module):
    """Router weight (E, hidden) and the fp32 selection bias (E,), replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x.float(), self.weight.float())


class Expert(nn.Module):
    """One expert's gated MLP; ``forward`` returns this rank's partial down projection (the MoE
    block all-reduces the sum over experts once)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(self.act_fn(self.gate_up_proj(x)), self.down_proj.weight)


class SigmoidGroupedTopKMoE(nn.Module):
    """``experts`` (E gated MLPs, HF names ``experts.{e}.{gate,up,down}_proj``) and ``gate``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"n_routed_experts ({num_experts}) must split into n_group ({n_group}) groups of at "
                             "least 2 experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"num_experts_per_tok must be in [1, {topk_group * (num_experts // n_group)}] "
                             f"(experts in topk_group groups), got {top_k}")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, float(routed_scaling_factor)
        self.gate = MoEGate(hidden_size, num_experts)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk_sigmoid(
            self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.norm_topk_prob, self.routed_scaling_factor,
        )
        ids, order = ids.sort(dim=-1)  # each token sums its experts in ascending id order, as HF does
        weights = weights.gather(1, order)
        contrib = x.new_zeros(x.shape[0], self.top_k, x.shape[1])
        for e in ids.unique().tolist():
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            out = self.experts[e](x[tokens]) * weights[tokens, slots, None]
            contrib[tokens, slots] = out.to(contrib.dtype)
        total = contrib[:, 0]
        for j in range(1, self.top_k):
            total = total + contrib[:, j]
        return tensor_model_parallel_all_reduce(total)
