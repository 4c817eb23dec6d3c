"""Host pool for the DSA indexer: index keys + fp32 scales, addressed with the KV anchor's slots."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.layout import HostLayout


class DSAIndexerPoolHost(HostKVCache):
    """A sidecar: sized and paged as ``anchor_host`` (upstream's constructor), whose allocator
    hands out the slots. ``kv_buffer`` is (index_k, index_scale)."""

    kind = PoolKind.DSA_INDEXER

    def __init__(
        self,
        device_pool,
        anchor_host: HostKVCache,
        layout: str | HostLayout,
        pin_memory: bool | None = None,
        device: str = "cpu",
        allocator_type: str = "default",
        *,
        io_backend=None,
    ):
        if not isinstance(anchor_host, HostKVCache):
            raise TypeError(f"anchor_host must be the anchor's host pool, got {type(anchor_host).__name__}")
        super().__init__(device_pool, page_size=anchor_host.page_size, layout=layout, pin_memory=pin_memory,
                         device=device, allocator_type=allocator_type, io_backend=io_backend, size=anchor_host.size)

    @property
    def index_k_buffer(self):
        return self.kv_buffer[0]

    @property
    def index_k_scale_buffer(self):
        return self.kv_buffer[1]
