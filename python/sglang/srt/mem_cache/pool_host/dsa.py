"""Host pool for the DSA indexer: index keys + fp32 scales, addressed with the KV anchor's slots."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.base import HostKVCache


class DSAIndexerPoolHost(HostKVCache):
    """A sidecar: build it with ``size=`` the anchor host pool's size and the anchor's layout;
    the anchor's allocator hands out the slots."""

    kind = PoolKind.DSA_INDEXER
