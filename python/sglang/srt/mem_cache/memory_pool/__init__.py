"""Device (L1) pools, one class per pool kind."""

from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind
from sglang.srt.mem_cache.memory_pool.dsa import DSAIndexerPool
from sglang.srt.mem_cache.memory_pool.dsv4 import DeepSeekV4StatePool, LogicalAnchorPool
from sglang.srt.mem_cache.memory_pool.mamba import MambaPool
from sglang.srt.mem_cache.memory_pool.mha import AsymmetricMHATokenToKVPool, MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.mla import MLATokenToKVPool
from sglang.srt.mem_cache.memory_pool.req_to_token import ReqToTokenPool

__all__ = [
    "AsymmetricMHATokenToKVPool",
    "DSAIndexerPool",
    "DeepSeekV4StatePool",
    "KVCache",
    "KVComponent",
    "LogicalAnchorPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "MambaPool",
    "PoolKind",
    "ReqToTokenPool",
]
