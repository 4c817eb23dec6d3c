"""The attention layer of a model: holds head geometry, delegates to the batch's backend."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed import get_tensor_model_parallel_rank


class RadixAttention(nn.Module):
    """Attention over the paged KV cache for absolute layer ``layer_id``.

    ``forward(q, k, v, forward_batch)`` takes this rank's heads, ``q`` (T, num_heads, head_dim),
    ``k``/``v`` (T, num_kv_heads, head_dim / v_head_dim), stores k/v at
    ``forward_batch.out_cache_loc`` and returns (T, num_heads * v_head_dim).

    ``layer_id`` indexes the layer in the KV pool (a model whose pool holds only some of its layers
    numbers them in pool order). ``v_head_dim`` defaults to ``head_dim`` (MLA in latent form and
    asymmetric MHA differ).

    ``sliding_window`` W: a query at position p attends keys p - W + 1 .. p only (HF's
    ``sliding_window``; None: all earlier keys). ``with_sinks``: the layer owns ``sinks``, one
    learned logit per attention head (this rank's heads; the loader takes the full vector and keeps
    this rank's slice) that joins the softmax denominator and carries no value (gpt-oss, MiMo).
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 v_head_dim: int | None = None, sliding_window: int | None = None, with_sinks: bool = False):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (keys a query sees, itself included), got {sliding_window}")
        self.sliding_window = sliding_window
        self.sinks = None
        if with_sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        shard = loaded_weight.narrow(0, get_tensor_model_parallel_rank() * n, n)
        if tuple(shard.shape) != (n,):
            raise ValueError(f"attention sinks: checkpoint shard has shape {tuple(shard.shape)}, expected ({n},)")
        param.data.copy_(shard)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch, save_kv_cache: bool = True,
                key_positions: torch.Tensor | None = None):
        """``key_positions`` (T, K), optional: the key positions each row may attend (sparse
        attention; -1 entries unused), see ``TorchNativeAttnBackend.forward``."""
        if key_positions is None:
            return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache,
                                                  key_positions=key_positions)
