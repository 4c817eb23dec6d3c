"""Host pool for MLA: one latent buffer (kv_lora_rank + rope dim) per token per layer."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class MLATokenToKVPoolHost(HostKVCache):
    kind = PoolKind.MLA

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.host_buffer("kv")

    @property
    def kv_cache_dim(self) -> int:
        return self.device_pool.kv_cache_dim
