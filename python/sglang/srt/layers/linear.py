"""Linear layers with tensor parallelism (column- and row-sharded), HF weight loaders.

Every weight carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes the
full (unsharded) checkpoint tensor and copies this rank's slice into the parameter.

Batch invariance: BLAS picks different kernels for small row counts than for large ones, and
those kernels round differently. Where the switch happens depends on the CPU and on the inner
dimension: 1-3 rows on some machines, up to 15 rows (K >= 512) on AVX-512/AMX Xeons. Some kernel
sets also treat the rows past the last whole tile of rows apart (MKL's generic path, taken under
``MKL_CBWR=COMPATIBLE``: tiles of 4 rows). ``gemm_rows(n)`` rounds a row count up to a multiple of
``MIN_GEMM_ROWS`` (at least ``MIN_GEMM_ROWS``), and ``invariant_linear`` pads its input to it, so
every row lies in a whole tile of a kernel chosen for a large call, and a token's output does not
depend on how many tokens share the call (checked on Intel Xeon and AMD EPYC with MKL/oneDNN; on
CUDA cuBLAS heuristics still vary with shape, see docs/engine.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)

MIN_GEMM_ROWS = 16


def gemm_rows(n: int) -> int:
    """The row count a batch-invariant GEMM of ``n`` rows runs with: ``n`` rounded up to a
    multiple of ``MIN_GEMM_ROWS`` (``MIN_GEMM_ROWS`` for ``n`` = 0)."""
    return max(MIN_GEMM_ROWS, -(-n // MIN_GEMM_ROWS) * MIN_GEMM_ROWS)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for 2-D ``x`` whose rows do not depend on the row count."""
    n = x.shape[0]
    if n and n != gemm_rows(n):
        x = torch.cat([x, x.new_zeros(gemm_rows(n) - n, x.shape[1])])
    out = F.linear(x, weight)[:n]
    return out if bias is None else out + bias


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor parallel size ({denominator})")
    return numerator // denominator


def _make_param(shape: tuple[int, ...], dtype: torch.dtype | None, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def _check_shape(param: torch.Tensor, shard: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(shard.shape):
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(shard.shape)}, expected {tuple(param.shape)}")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split along its output rows; each rank returns its slice of Y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.weight = _make_param((self.output_size_per_partition, input_size), params_dtype, self.weight_loader)
        self.bias = _make_param((self.output_size_per_partition,), params_dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        _check_shape(param, shard, type(self).__name__)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one weight (e.g. gate_up_proj);
    ``shard_id`` is the index of the projection in ``output_sizes``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, params_dtype=None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype)
        for i, size in enumerate(self.output_sizes):
            divide(size, self.tp_size, f"output size {i}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        target = param.data.narrow(0, offset, size)
        _check_shape(target, shard, f"{type(self).__name__}[{shard_id}]")
        target.copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection sharded by attention heads. When the TP size exceeds the number
    of KV heads, each KV head is replicated on ``tp_size // total_num_kv_heads`` ranks.
    ``v_head_size`` (default ``head_size``) differs for asymmetric heads (MiMo-V2-Flash)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        params_dtype=None,
        v_head_size: int | None = None,
    ):
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.v_head_size = head_size if v_head_size is None else v_head_size
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor parallel size {tp_size} exceeds num_key_value_heads {total_num_kv_heads} "
                    "and must then be a multiple of it"
                )
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        out = (self.num_heads * head_size + self.num_kv_heads * (head_size + self.v_head_size)) * tp_size
        super().__init__(hidden_size, out, bias, params_dtype)

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in param, size, start in checkpoint tensor) along dim 0."""
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        v_size = self.num_kv_heads * self.v_head_size
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        table = {
            "q": (0, q_size, self.tp_rank * q_size),
            "k": (q_size, kv_size, kv_rank * kv_size),
            "v": (q_size + kv_size, v_size, kv_rank * v_size),
        }
        if shard_id not in table:
            raise ValueError(f"shard_id must be one of {sorted(table)}, got {shard_id!r}")
        return table[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        offset, size, start = self._shard_layout(shard_id)
        target = param.data.narrow(0, offset, size)
        shard = loaded_weight.narrow(0, start, size)
        _check_shape(target, shard, f"{type(self).__name__}[{shard_id}]")
        target.copy_(shard)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split along its input columns; X arrives sharded and the partial
    products are summed over ranks. The bias (replicated) is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, params_dtype=None):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.weight = _make_param((output_size, self.input_size_per_partition), params_dtype, self.weight_loader)
        self.bias = _make_param((output_size,), params_dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        shard = loaded_weight
        if param.dim() == 2:
            size = param.shape[1]
            shard = loaded_weight.narrow(1, self.tp_rank * size, size)
        _check_shape(param, shard, type(self).__name__)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tensor_model_parallel_all_reduce(invariant_linear(x, self.weight))
        return out if self.bias is None else out + self.bias
