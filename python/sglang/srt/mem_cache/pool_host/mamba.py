"""Host pool for Mamba state: one slot per request (page_size 1), temporal + conv buffers."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.layout import HostLayout


class MambaPoolHost(HostKVCache):
    """Flat pages are the raw bytes of one request's states: temporal, then conv_0, conv_1, ..."""

    kind = PoolKind.MAMBA

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0.0,
        page_size: int | None = None,
        layout=HostLayout.PAGE_FIRST_DIRECT,
        io_backend=None,
        pin_memory=None,
        size=None,
    ):
        if page_size not in (None, 1):
            raise ValueError(f"MambaPoolHost holds one slot per request: page_size must be 1, got {page_size}")
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, 1, layout, io_backend, pin_memory, size)

    @property
    def temporal_buffer(self) -> torch.Tensor:
        return self.host_buffer("temporal")

    @property
    def conv_buffers(self) -> list[torch.Tensor]:
        return [self.host_buffer(c.name) for c in self.components if c.name.startswith("conv_")]
