"""DSA (DeepSeek sparse attention) indexer pool: a sidecar of the KV anchor.

Per token and indexer layer: an indexer key (``index_head_dim`` values of ``dtype``) and its fp32
scale. It has no allocator: it is addressed with the KV anchor's token slots.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind


class DSAIndexerPool(KVCache):
    kind = PoolKind.DSA_INDEXER

    def __init__(
        self,
        size: int,
        page_size: int,
        index_head_dim: int,
        layer_num: int,
        dtype: torch.dtype = torch.bfloat16,
        device="cpu",
        start_layer: int = 0,
    ):
        self.index_head_dim = index_head_dim
        components = (
            KVComponent("index_k", dtype, (index_head_dim,)),
            KVComponent("index_scale", torch.float32, (1,)),
        )
        super().__init__(size, page_size, layer_num, components, device, start_layer)

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("index_k", layer_id)

    def get_index_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("index_scale", layer_id)

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor, scale: torch.Tensor) -> None:
        self.write_layer("index_k", layer_id, loc, index_k)
        self.write_layer("index_scale", layer_id, loc, scale)
