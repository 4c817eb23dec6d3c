"""MLA device pool: one compressed latent (kv_lora_rank + rope dim) per token per layer."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind


class MLATokenToKVPool(KVCache):
    kind = PoolKind.MLA

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device="cpu",
        start_layer: int = 0,
    ):
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        components = (KVComponent("kv", dtype, (1, self.kv_cache_dim)),)
        super().__init__(size, page_size, layer_num, components, device, start_layer)

    @property
    def kv_buffer(self) -> list[torch.Tensor]:
        return list(self.buffers["kv"].unbind(0))

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("kv", layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v=None) -> None:
        self.write_layer("kv", layer_id, loc, cache_k)

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        self.write_layer("kv", layer_id, loc, torch.cat([cache_k_nope, cache_k_rope], dim=-1))
