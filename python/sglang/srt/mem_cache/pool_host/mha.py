"""Host pools for MHA/GQA and asymmetric MHA: separate K and V buffers."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class MHATokenToKVPoolHost(HostKVCache):
    """K and V, each (head_num, head_dim) per token per layer; all four layouts."""

    kind = PoolKind.MHA

    @property
    def head_num(self) -> int:
        return self.device_pool.head_num

    @property
    def head_dim(self) -> int:
        return self.device_pool.head_dim

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.host_buffer("k")

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.host_buffer("v")

    def get_ksize_per_token(self) -> int:
        """Bytes of K per token over all layers."""
        return self.components[0].item_bytes * self.layer_num


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
    """K (head_num, head_dim) and V (head_num, v_head_dim), head_dim != v_head_dim.

    With page_first_direct the buffers are (page_num, layer_num, page_size, head_num, dim) with
    their own dims, and the direct routine moves K and V by separate calls.
    """

    kind = PoolKind.ASYMMETRIC_MHA

    @property
    def v_head_dim(self) -> int:
        return self.device_pool.v_head_dim
