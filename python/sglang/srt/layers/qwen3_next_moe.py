"""Sparse MoE with a gated shared expert (Qwen3-Next / Qwen2-MoE style), tensor parallel.

Routing: softmax over ``num_experts`` router logits (fp32), top-k, optionally renormalised. Each
expert and the shared expert are SwiGLU MLPs whose intermediate dimension is sharded over TP
ranks (gate_up column-parallel, down row-parallel); the ranks' partial sums of all experts plus
the shared expert are reduced with one all-reduce. The shared expert is scaled by
``sigmoid(x @ shared_expert_gate)``.

Batch invariance: every GEMM goes through ``invariant_linear`` (rows padded to MIN_GEMM_ROWS) and
a token's expert outputs are accumulated in expert order, so its result does not depend on which
other tokens share the batch. Checkpoint names are HF's per-expert ones
(``mlp.experts.<e>.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import (
    MIN_GEMM_ROWS,
    MergedColumnParallelLinear,
    RowParallelLinear,
    invariant_linear,
)
from sglang.srt.models.weight_names import default_weight_loader


class ExpertMLP(nn.Module):
    """SwiGLU MLP returning this rank's partial sum (no all-reduce): the MoE block reduces once."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(self.act_fn(self.gate_up_proj(x)), self.down_proj.weight)


def narrow_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``invariant_linear`` for a weight of few output rows (the shared-expert gate has one): BLAS
    takes a GEMV-like path there whose rounding depends on the row count, so the weight is padded
    with zero rows to MIN_GEMM_ROWS outputs and the extra columns dropped."""
    n = weight.shape[0]
    if n < MIN_GEMM_ROWS:
        weight = torch.cat([weight, weight.new_zeros(MIN_GEMM_ROWS - n, weight.shape[1])])
    return invariant_linear(x, weight)[:, :n]


def _replicated(shape: tuple[int, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Router(nn.Module):
    """``weight`` (num_experts, hidden), replicated on every rank (HF ``mlp.gate.weight``)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = _replicated((num_experts, hidden_size))


class SharedExpertGate(nn.Module):
    """``weight`` (1, hidden), replicated (HF ``mlp.shared_expert_gate.weight``)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = _replicated((1, hidden_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_expert_intermediate_size: int, norm_topk_prob: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts))
        self.shared_expert = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = ExpertMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = SharedExpertGate(hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, top_k) in x's dtype, expert ids (N, top_k))."""
        logits = narrow_linear(x, self.gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None:
            gate = torch.sigmoid(narrow_linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(out)
