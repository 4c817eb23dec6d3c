"""Host pool for MLA: one latent buffer (kv_lora_rank + rope dim) per token per layer."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class MLATokenToKVPoolHost(HostKVCache):
    """``kv_buffer`` is the one latent tensor, shaped by the layout with items (1, kv_cache_dim)."""

    kind = PoolKind.MLA

    def __init__(self, device_pool, *args, **kwargs):
        super().__init__(device_pool, *args, **kwargs)
        self.kv_cache_dim = device_pool.kv_cache_dim
