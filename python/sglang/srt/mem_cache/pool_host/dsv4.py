"""DeepSeek-V4 host pools: the logical anchor (slots only) and the compressed-row state pool."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class LogicalHostPool(HostKVCache):
    """A slot allocator with no bytes: copies are no-ops, flat pages are empty, there are no
    page buffers, and ``is_stride_page_aligned`` is vacuously true."""

    kind = PoolKind.DSV4_ANCHOR


class DeepSeekV4StateHostPool(HostKVCache):
    """Compressed rows addressed with the anchor's slots (build with ``size=`` the anchor's)."""

    kind = PoolKind.DSV4_STATE
