"""Mixture of experts: one top-k router, routed experts, optional shared expert(s), one all-reduce.

Used by DeepSeek-V2/V3 (``DeepseekMoE``), MiMo-V2-Flash and Qwen3-Next (``SparseMoE`` built by
the model). Router (replicated): scores are ``softmax`` (V2, Qwen3-Next) or ``sigmoid`` (V3,
MiMo) of the router logits. Experts are chosen by

* ``greedy``: top-k of the scores;
* ``group_limited_greedy`` (V2): the experts split into ``n_group`` groups, a group scores its
  best expert, only the ``topk_group`` best groups compete (others are zeroed);
* ``noaux_tc`` (V3, MiMo): ``e_score_correction_bias`` is added to the scores for the choice only,
  a group scores the sum of its two best biased scores, the non-selected groups are -inf.

The weights are the (unbiased) scores of the chosen experts, normalized to sum 1 when
``norm_topk_prob``, times ``routed_scaling_factor``. The logits are fp32 (``x`` and the weight
upcast) by default; ``model_dtype_logits`` (Qwen3-Next, as HF computes it) takes them in the
model dtype (the router weight padded to ``MIN_GEMM_ROWS`` rows) and returns the weights in it.

Experts run as a plain loop over the experts that received tokens; any expert count works. A
token's weighted expert outputs are summed in ascending expert order, in fp32 (DeepSeek) or in
the model dtype (``accumulate_fp32=False``: MiMo, Qwen3-Next, as their HF code does). The shared
expert is added unscaled (DeepSeek ``shared_experts``) or scaled by
``sigmoid(x @ shared_expert_gate)`` (Qwen3-Next ``shared_expert``). Under TP each expert's (and
the shared expert's) intermediate dimension is split over the ranks: ``gate_up_proj``
column-parallel, ``down_proj`` row-parallel without its own reduction; the routed and shared
partial sums are all-reduced once.

Batch invariance: every GEMM goes through ``invariant_linear`` (>= ``MIN_GEMM_ROWS`` rows), and a
token's expert outputs are accumulated in expert order, so its result does not depend on which
other tokens share the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import (
    MIN_GEMM_ROWS,
    MergedColumnParallelLinear,
    RowParallelLinear,
    invariant_linear,
)

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SIMD_PAD = 64  # floats: two AVX-512 vectors (the widest unrolled step of torch's CPU loops), with room


class RowParallelPartial(RowParallelLinear):
    """A row-parallel linear that returns this rank's partial product (the caller reduces)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise ValueError("a partial row-parallel linear cannot carry a bias (it would be added per rank)")
        return invariant_linear(x, self.weight)


class GatedMLPPartial(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the intermediate dim sharded; returns the partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelPartial(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def rowwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` of (T, E) whose rows do not depend on T. A flat elementwise kernel computes its
    tail (past the last whole pair of SIMD vectors) with the scalar function, which rounds
    differently from the vector one; padding every row to a multiple of ``SIMD_PAD`` puts every
    element on the vector path."""
    pad = -x.shape[-1] % SIMD_PAD
    return F.pad(x, (0, pad)).sigmoid()[..., : x.shape[-1]] if pad else x.sigmoid()


def narrow_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``invariant_linear`` for a weight of few output rows (a router of few experts, the shared
    expert gate's one): BLAS takes a GEMV-like path there whose rounding depends on the row count,
    so the weight is padded with zero rows to MIN_GEMM_ROWS outputs and the extra columns dropped."""
    n = weight.shape[0]
    if n < MIN_GEMM_ROWS:
        weight = torch.cat([weight, weight.new_zeros(MIN_GEMM_ROWS - n, weight.shape[1])])
    return invariant_linear(x, weight)[:, :n]


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score) -> torch.Tensor:
    """(T, E) bool: True for experts in each token's ``topk_group`` best groups."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    best = torch.topk(group_score(grouped), k=topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, best, True)
    return mask.unsqueeze(-1).expand(-1, -1, experts // n_group).reshape(tokens, experts)


class TopKRouter(nn.Module):
    """Router logits -> (topk_weights (T, k), topk_ids (T, k) int64); the weights are fp32, or in
    ``x``'s dtype with ``model_dtype_logits``. ``sorted_topk``: greedy top-k in descending score
    order (HF Qwen's ``torch.topk`` default; it fixes the order the normalization sums in)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str = "softmax",
        topk_method: str = "greedy",
        n_group: int | None = None,
        topk_group: int | None = None,
        norm_topk_prob: bool = False,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = False,
        model_dtype_logits: bool = False,
        sorted_topk: bool = False,
    ):
        super().__init__()
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring_func {scoring_func!r}; supported: {list(SCORING_FUNCS)}")
        if topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {topk_method!r}; supported: {list(TOPK_METHODS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={num_experts}], got {top_k}")
        grouped = topk_method != "greedy"
        n_group, topk_group = (n_group or 1, topk_group or 1) if grouped else (1, 1)
        if grouped and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(
                f"n_group ({n_group}) must divide n_routed_experts ({num_experts}) and topk_group ({topk_group}) "
                f"must be in [1, n_group]"
            )
        if topk_method == "noaux_tc" and num_experts // n_group < 2:
            raise ValueError(f"noaux_tc scores a group by its two best experts: n_routed_experts ({num_experts}) / "
                             f"n_group ({n_group}) must be >= 2")
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring_func, self.topk_method = scoring_func, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.model_dtype_logits, self.sorted_topk = model_dtype_logits, sorted_topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = None
        if correction_bias:  # fp32 whatever the model dtype, as HF keeps it
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.model_dtype_logits:
            logits = narrow_linear(x, self.weight).float()
        else:
            logits = invariant_linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.scoring_func == "softmax" else rowwise_sigmoid(logits)
        if self.topk_method == "greedy":
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=self.sorted_topk)
        elif self.topk_method == "group_limited_greedy":
            mask = _group_mask(scores, self.n_group, self.topk_group, lambda g: g.amax(dim=-1))
            weights, ids = torch.topk(scores.masked_fill(~mask, 0.0), k=self.top_k, dim=-1, sorted=False)
        else:  # noaux_tc
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
            mask = _group_mask(choice, self.n_group, self.topk_group, lambda g: g.topk(2, dim=-1).values.sum(-1))
            ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return (weights.to(x.dtype) if self.model_dtype_logits else weights), ids


class FusedMoE(nn.ModuleList):
    """Routed experts: item ``e`` holds ``gate_up_proj`` / ``down_proj`` (the HF names
    ``experts.{e}.gate_proj/up_proj/down_proj``, gate and up fused on load), TP-sharded along the
    intermediate dim. ``forward`` returns this rank's partial sum (reduce it once, with any other
    partial sums) in ``x``'s dtype, accumulated in fp32 or (``accumulate_fp32=False``) in ``x``'s dtype."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, accumulate_fp32: bool = True):
        super().__init__(GatedMLPPartial(hidden_size, intermediate_size) for _ in range(num_experts))
        self.num_experts, self.accumulate_fp32 = num_experts, accumulate_fp32

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        acc_dtype = torch.float32 if self.accumulate_fp32 else x.dtype
        out = torch.zeros(x.shape[0], x.shape[1], dtype=acc_dtype, device=x.device)
        # One host sync for the routing table; experts in increasing order, so every token adds its
        # expert outputs in the same order whatever the batch.
        hit = torch.unique(topk_ids).tolist()
        for e in hit:
            token_idx, slot = torch.where(topk_ids == e)
            y = self[e](x[token_idx]) * topk_weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y.to(acc_dtype))
        return out.to(x.dtype)


class ReplicatedWeight(nn.Module):
    """A ``weight`` of ``shape`` held whole on every rank (e.g. HF ``mlp.shared_expert_gate.weight``)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)


class SparseMoE(nn.Module):
    """``gate`` (a ``TopKRouter``) + routed ``experts`` + an optional shared expert named
    ``shared_name`` (its checkpoint prefix), scaled by ``sigmoid(x @ shared_expert_gate)`` when
    ``shared_gate``; one all-reduce."""

    def __init__(self, router: TopKRouter, hidden_size: int, intermediate_size: int,
                 shared_intermediate_size: int = 0, *, shared_name: str = "shared_experts",
                 shared_gate: bool = False, accumulate_fp32: bool = True):
        super().__init__()
        self.gate = router
        self.experts = FusedMoE(router.num_experts, hidden_size, intermediate_size, accumulate_fp32)
        self.shared_name = shared_name
        shared = GatedMLPPartial(hidden_size, shared_intermediate_size) if shared_intermediate_size > 0 else None
        setattr(self, shared_name, shared)
        self.shared_expert_gate = ReplicatedWeight(1, hidden_size) if shared is not None and shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        shared = getattr(self, self.shared_name)
        if shared is not None:
            y = shared(x)
            if self.shared_expert_gate is not None:
                y = torch.sigmoid(narrow_linear(x, self.shared_expert_gate.weight)) * y
            out = out + y
        return tensor_model_parallel_all_reduce(out)


class DeepseekMoE(SparseMoE):
    """DeepSeek-V2/V3: the config's router + routed experts + ``n_shared_experts`` shared experts
    (one MLP of ``n_shared_experts * moe_intermediate_size``), fp32 accumulation."""

    def __init__(self, config):
        router = TopKRouter(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            scoring_func=config.scoring_func,
            topk_method=config.topk_method,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
            correction_bias=config.topk_method == "noaux_tc",
        )
        shared = config.n_shared_experts or 0
        super().__init__(router, config.hidden_size, config.moe_intermediate_size,
                         config.moe_intermediate_size * shared)


def gated_mlp_shapes(prefix: str, hidden: int, inter: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """``{prefix}{gate,up,down}_proj.weight`` (and ``.bias``) of a gated MLP, full shapes."""
    shapes = {}
    for name, shape in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        shapes[f"{prefix}{name}.weight"] = shape
        if bias:
            shapes[f"{prefix}{name}.bias"] = shape[:1]
    return shapes


def moe_weight_shapes(prefix: str, hidden: int, num_experts: int, intermediate_size: int, *,
                      correction_bias: bool = False, shared_name: str = "shared_experts",
                      shared_intermediate_size: int = 0, shared_gate: bool = False) -> dict[str, tuple[int, ...]]:
    """The HF tensors of a ``SparseMoE`` at ``prefix`` (e.g. ``model.layers.3.mlp.``), full shapes."""
    shapes = {f"{prefix}gate.weight": (num_experts, hidden)}
    if correction_bias:
        shapes[f"{prefix}gate.e_score_correction_bias"] = (num_experts,)
    for e in range(num_experts):
        shapes.update(gated_mlp_shapes(f"{prefix}experts.{e}.", hidden, intermediate_size))
    if shared_intermediate_size > 0:
        shapes.update(gated_mlp_shapes(f"{prefix}{shared_name}.", hidden, shared_intermediate_size))
        if shared_gate:
            shapes[f"{prefix}shared_expert_gate.weight"] = (1, hidden)
    return shapes
