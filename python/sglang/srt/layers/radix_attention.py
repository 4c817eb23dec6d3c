"""The attention layer of a model: holds head geometry, delegates to the batch's backend."""

from __future__ import annotations

import torch
from torch import nn


class RadixAttention(nn.Module):
    """Attention over the paged KV cache for absolute layer ``layer_id``.

    ``forward(q, k, v, forward_batch)`` takes this rank's heads, ``q`` (T, num_heads, head_dim),
    ``k``/``v`` (T, num_kv_heads, head_dim / v_head_dim), stores k/v at
    ``forward_batch.out_cache_loc`` and returns (T, num_heads * v_head_dim).

    ``layer_id`` indexes the layer in the KV pool (a model whose pool holds only some of its layers
    numbers them in pool order). ``v_head_dim`` defaults to ``head_dim`` (MLA in latent form and
    asymmetric MHA differ).
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 v_head_dim: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch, save_kv_cache: bool = True):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
