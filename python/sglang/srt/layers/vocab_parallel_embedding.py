"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of rows.

The vocabulary is padded to a multiple of the TP size; padded rows are zero and their logits
are cut off by the logits processor.
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


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows ``[vocab_start, vocab_end)`` live on this rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype=None):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.rows_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        self.vocab_end = min(self.vocab_start + self.rows_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_partition, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"{type(self).__name__}: checkpoint has shape {tuple(loaded_weight.shape)}, "
                f"expected {(self.num_embeddings, param.shape[1])}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with the embedding's sharding; used through ``LogitsProcessor``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
