"""Host pool for Mamba state: one slot per request (page_size 1), temporal + conv buffers."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.layout import HostLayout


class MambaPoolHost(HostKVCache):
    """Upstream's constructor: no page_size (one slot per request); the layout defaults to
    ``page_first_direct`` (one contiguous run per request state). ``kv_buffer`` is the tuple
    (temporal, conv_0, conv_1, ...); flat pages are one request's states in that order."""

    kind = PoolKind.MAMBA

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float = 2.0,
        host_size: float = 0.0,
        pin_memory: bool | None = None,
        device: str = "cpu",
        allocator_type: str = "default",
        layout: str | HostLayout = HostLayout.PAGE_FIRST_DIRECT,
        *,
        io_backend=None,
        size: int | None = None,
    ):
        super().__init__(device_pool, host_to_device_ratio, host_size, 1, layout, pin_memory, device, allocator_type,
                         io_backend=io_backend, size=size)

    def init_kv_buffer(self) -> tuple[torch.Tensor, ...]:
        buffers = super().init_kv_buffer()
        return buffers if isinstance(buffers, tuple) else (buffers,)

    @property
    def temporal_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def conv_buffer(self) -> list[torch.Tensor]:
        return list(self.kv_buffer[1:])
