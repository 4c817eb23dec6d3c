"""Next-token logits: the last hidden state of each request through the (vocab-parallel) LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_gather
from sglang.srt.layers.linear import invariant_linear


@dataclass
class LogitsProcessorOutput:
    """``next_token_logits``: (batch_size, vocab_size) fp32, identical on every TP rank."""

    next_token_logits: torch.Tensor


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module, forward_batch) -> LogitsProcessorOutput:
        """``hidden_states``: (num_tokens, hidden) for the whole batch; the last token of each
        request (its ``extend_seq_lens`` segment) is projected."""
        last = forward_batch.last_token_indices
        logits = invariant_linear(hidden_states[last], lm_head.weight)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.vocab_size]
        return LogitsProcessorOutput(next_token_logits=logits.float())
