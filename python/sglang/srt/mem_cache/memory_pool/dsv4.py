"""DeepSeek-V4 style pair: a logical anchor (slots, no bytes) and a state pool of compressed rows."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind


class LogicalAnchorPool(KVCache):
    """Allocates token slots that the tree tracks, and holds no bytes.

    Side pools (the V4 state pool, ...) are addressed with its slots.
    """

    kind = PoolKind.DSV4_ANCHOR

    def __init__(self, size: int, page_size: int, layer_num: int, device="cpu", start_layer: int = 0):
        super().__init__(size, page_size, layer_num, (), device, start_layer)


class DeepSeekV4StatePool(KVCache):
    """One compressed row (``row_dim`` values of ``dtype``) per anchor slot per layer."""

    kind = PoolKind.DSV4_STATE

    def __init__(
        self,
        size: int,
        page_size: int,
        row_dim: int,
        layer_num: int,
        dtype: torch.dtype = torch.bfloat16,
        device="cpu",
        start_layer: int = 0,
    ):
        self.row_dim = row_dim
        super().__init__(size, page_size, layer_num, (KVComponent("state", dtype, (row_dim,)),), device, start_layer)

    def get_state_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("state", layer_id)
