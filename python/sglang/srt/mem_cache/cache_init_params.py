"""CacheInitParams: the one source of parallel coordinates for every cache component.

Controllers, hybrid stack builders and the storage config read tp/pp/attention-cp rank and size
from here and from nowhere else (upstream read pp from three places and disagreed with itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionPolicy

EVICTION_POLICIES = tuple(p.value for p in EvictionPolicy)


@dataclass(frozen=True)
class ParallelCoords:
    """This rank's place in the tp x pp x attention-cp grid (attribute names match
    ``HiCacheStorageConfig``, so a storage config can be derived from it)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int


def check_parallel_coords(obj) -> None:
    """Raise ValueError unless ``obj``'s tp/pp/attn_cp ranks lie in [0, size) with size >= 1."""
    for name in ("tp", "pp", "attn_cp"):
        rank, size = getattr(obj, f"{name}_rank"), getattr(obj, f"{name}_size")
        if size < 1:
            raise ValueError(f"{name}_size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"{name}_rank must be in [0, {name}_size={size}), got {rank}")


@dataclass
class CacheInitParams:
    """Everything a radix cache and its controllers need to be built.

    ``tp_cache_group`` is a gloo process group over the TP ranks that share one tree (None for a
    single rank); when given, its rank and size must equal ``tp_rank`` / ``tp_size``. Every TP
    agreement of the HiCache tree (an all-reduce MIN) runs over it.
    """

    page_size: int = 1
    token_to_kv_pool_allocator: Any = None
    req_to_token_pool: Any = None
    disable: bool = False
    eviction_policy: str = "lru"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    tp_cache_group: Any = None
    enable_metrics: bool = False
    enable_kv_cache_events: bool = False

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        EvictionPolicy.parse(self.eviction_policy)
        check_parallel_coords(self)
        group = self.tp_cache_group
        if group is not None:
            import torch.distributed as dist

            g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
            if (g_rank, g_size) != (self.tp_rank, self.tp_size):
                raise ValueError(
                    f"tp_cache_group has rank {g_rank} of {g_size} but tp_rank={self.tp_rank}, "
                    f"tp_size={self.tp_size}; they must agree"
                )

    @property
    def parallel_coords(self) -> ParallelCoords:
        """tp/pp/attention-cp rank and size, read by every controller, builder and storage config."""
        return ParallelCoords(
            self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.attn_cp_rank, self.attn_cp_size
        )
