"""MHA/GQA and asymmetric-MHA device pools: K and V per token per layer."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind


class MHATokenToKVPool(KVCache):
    """K and V, each (head_num, head_dim) per token per layer."""

    kind = PoolKind.MHA

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device="cpu",
        start_layer: int = 0,
        v_head_dim: int | None = None,
    ):
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        components = (
            KVComponent("k", dtype, (head_num, head_dim)),
            KVComponent("v", dtype, (head_num, self.v_head_dim)),
        )
        self._layer_cache: dict[str, tuple] = {}
        super().__init__(size, page_size, layer_num, components, device, start_layer)

    def _layers(self, name: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-layer views of component ``name`` and a uint64 table of their addresses (on the
        pool's device), made once per buffer."""
        buf = self.buffers[name]
        cached = self._layer_cache.get(name)
        if cached is None or cached[0] is not buf:
            layers = list(buf.unbind(0))
            ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64, device=self.device)
            cached = self._layer_cache[name] = (buf, layers, ptrs)
        return cached[1], cached[2]

    @property
    def k_buffer(self) -> list[torch.Tensor]:
        return self._layers("k")[0]

    @property
    def v_buffer(self) -> list[torch.Tensor]:
        return self._layers("v")[0]

    @property
    def k_data_ptrs(self) -> torch.Tensor:
        """Addresses of the K layers (uint64, on the pool's device): what a kernel copying every
        layer reads."""
        return self._layers("k")[1]

    @property
    def v_data_ptrs(self) -> torch.Tensor:
        return self._layers("v")[1]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("k", layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.layer_view("v", layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.write_layer("k", layer_id, loc, cache_k)
        self.write_layer("v", layer_id, loc, cache_v)


class AsymmetricMHATokenToKVPool(MHATokenToKVPool):
    """K (head_num, head_dim) and V (head_num, v_head_dim) with head_dim != v_head_dim."""

    kind = PoolKind.ASYMMETRIC_MHA

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        layer_num: int,
        device="cpu",
        start_layer: int = 0,
    ):
        if v_head_dim == head_dim:
            raise ValueError(
                f"AsymmetricMHATokenToKVPool needs v_head_dim != head_dim (both {head_dim}); use MHATokenToKVPool"
            )
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, start_layer, v_head_dim)
