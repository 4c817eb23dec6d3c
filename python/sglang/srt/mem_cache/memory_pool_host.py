"""DeepSeek-V4 host pools (upstream keeps them here): the logical anchor and the state rows.

- ``LogicalHostPool``: page-aligned token slots and no bytes. The compressed side pools use its
  slots as stable page anchors; copies are no-ops, flat pages are empty, it has no page buffers,
  and ``is_stride_page_aligned`` is vacuously true.
- ``DeepSeekV4StateHostPool``: compressed rows addressed with the anchor's slots.

Both take upstream's constructors; the other host pools live in ``pool_host/``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend


class LogicalHostPool(HostKVCache):
    """``size`` token slots in pages of ``page_size``; nothing stored (``kv_buffer`` is None)."""

    kind = PoolKind.DSV4_ANCHOR

    def __init__(
        self,
        size: int,
        page_size: int,
        layout: str | HostLayout = HostLayout.LAYER_FIRST,
        *,
        io_backend: str | IOBackend = IOBackend.DIRECT,
    ):
        if page_size < 1 or size < page_size or size % page_size:
            raise ValueError(f"LogicalHostPool size must be a positive multiple of page_size, got size={size}, "
                             f"page_size={page_size}")
        self.device_pool = None
        self.page_size = page_size
        self.layer_num = self.start_layer = self.end_layer = 0
        self.components = ()
        self.size_per_token = 0
        self.dtype = torch.uint8
        self._setup(size, layout, io_backend, False, "cpu", "default")

    def _check_device_pool(self, device_pool: KVCache) -> None:
        """Any logical anchor pool with this page size (it has no layers to match)."""
        if device_pool.kind is not self.kind or device_pool.page_size != self.page_size:
            raise ValueError(f"device pool {device_pool.kind.value} / page {device_pool.page_size} does not match "
                             f"this {self.kind.value} host pool / page {self.page_size}")


class DeepSeekV4StateHostPool(HostKVCache):
    """Host rows of the V4 state pool: ``num_host_pages`` pages of ``swa_page_size`` slots.

    ``state_pools`` lists the device state pools it mirrors; ours keeps every layer in one
    ``DeepSeekV4StatePool``, so it is a one-element list. ``pool_name`` names it in logs.
    """

    kind = PoolKind.DSV4_STATE

    def __init__(
        self,
        pool_name: str,
        state_pools: Sequence[KVCache],
        num_host_pages: int,
        swa_page_size: int,
        layout: str | HostLayout = HostLayout.LAYER_FIRST,
        device: str = "cpu",
        pin_memory: bool | None = None,
        allocator_type: str = "default",
        *,
        io_backend: str | IOBackend | None = None,
    ):
        pools = list(state_pools)
        if len(pools) != 1 or any(p is None for p in pools):
            raise ValueError(f"{pool_name}: state_pools must be [the DeepSeekV4StatePool] (one pool holds every "
                             f"layer), got {len(pools)} entries")
        self.pool_name = pool_name
        self.state_pools = pools
        self.num_host_pages = num_host_pages
        self.swa_page_size = swa_page_size
        super().__init__(pools[0], page_size=swa_page_size, layout=layout, pin_memory=pin_memory, device=device,
                         allocator_type=allocator_type, io_backend=io_backend, size=num_host_pages * swa_page_size)
