"""CacheInitParams: the one source of parallel coordinates for every cache component.

Controllers, hybrid stack builders and the storage config read tp/pp/attention-cp rank and size
from here and from nowhere else (upstream read pp from three places and disagreed with itself).
A controller built with upstream's keywords (``tp_group=``, ``pp_rank=``, ``attn_cp_group=``, ...)
builds one of these from them and reads them back from it.

Field names are upstream's (``disable``, ``req_to_token_pool``, ``token_to_kv_pool_allocator``,
``page_size``, ``tp_cache_group``, ``attn_cp_cache_group``, ``attn_tp_cache_group``,
``pp_cache_group``, ``eviction_policy``, ``eviction_policy_config``, ``enable_metrics``, ``enable_kv_cache_events``,
``pp_rank``/``pp_size``, ``attn_cp_rank``/``attn_cp_size``); ``tp_rank``/``tp_size`` are ours (upstream
reads them from the group). A rank or size left None is read from its group (0 / 1 without one);
one given beside its group must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionPolicy, check_policy_config

EVICTION_POLICIES = tuple(p.value for p in EvictionPolicy)

# coordinate -> the CacheInitParams field holding the process group it can be read from
_GROUP_OF = {"tp": "tp_cache_group", "pp": "pp_cache_group", "attn_cp": "attn_cp_cache_group"}


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


def _group_rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


@dataclass
class CacheInitParams:
    """Everything a radix cache and its controllers need to be built.

    ``tp_cache_group`` is a gloo process group over the TP ranks that share one tree (None for a
    single rank); every TP agreement of the HiCache tree (an all-reduce MIN) runs over it.
    ``pp_cache_group`` / ``attn_cp_cache_group``: the PP and attention-CP groups of this rank
    (None: the coordinates are given as numbers). ``attn_tp_cache_group``: upstream's
    attention-TP group under attention data parallelism, which this fork does not run: None or
    ``tp_cache_group`` itself. ``enable_kv_cache_events``: the tree records KV events.
    """

    disable: bool = False
    req_to_token_pool: Any = None
    token_to_kv_pool_allocator: Any = None
    page_size: int = 1
    tp_cache_group: Any = None
    attn_cp_cache_group: Any = None
    attn_tp_cache_group: Any = None
    pp_cache_group: Any = None
    eviction_policy: str = "lru"
    eviction_policy_config: dict[str, Any] | None = None
    enable_metrics: bool = False
    enable_kv_cache_events: bool = False
    pp_rank: int | None = None
    pp_size: int | None = None
    attn_cp_rank: int | None = None
    attn_cp_size: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        check_policy_config(EvictionPolicy.parse(self.eviction_policy), self.eviction_policy_config)
        for name, group_field in _GROUP_OF.items():
            self._settle_coordinate(name, group_field)
        check_parallel_coords(self)
        if self.attn_tp_cache_group is not None and self.attn_tp_cache_group is not self.tp_cache_group:
            raise ValueError("attn_tp_cache_group must be None or tp_cache_group itself: attention data "
                             "parallelism (a separate attention-TP group) is not supported")

    def _settle_coordinate(self, name: str, group_field: str) -> None:
        """Fill ``<name>_rank`` / ``<name>_size`` left None from the group (0 / 1 without one);
        ValueError when a given one differs from the group's."""
        group = getattr(self, group_field)
        rank_field, size_field = f"{name}_rank", f"{name}_size"
        rank, size = getattr(self, rank_field), getattr(self, size_field)
        if group is None:
            setattr(self, rank_field, 0 if rank is None else rank)
            setattr(self, size_field, 1 if size is None else size)
            return
        g_rank, g_size = _group_rank_size(group)
        if (rank is not None and rank != g_rank) or (size is not None and size != g_size):
            raise ValueError(
                f"{group_field} has rank {g_rank} of {g_size} but {rank_field}={rank}, {size_field}={size}; "
                "they must agree"
            )
        setattr(self, rank_field, g_rank)
        setattr(self, size_field, g_size)

    @property
    def parallel_coords(self) -> ParallelCoords:
        """tp/pp/attention-cp rank and size, read by every controller, builder and storage config."""
        return ParallelCoords(
            self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.attn_cp_rank, self.attn_cp_size
        )

    def check_same_cache(self, other: CacheInitParams) -> None:
        """ValueError unless ``other`` (e.g. the one a controller built from its keywords) has
        this page size, allocator, TP group and parallel coordinates, naming what differs."""
        for field in ("token_to_kv_pool_allocator", "tp_cache_group"):
            if getattr(self, field) is not getattr(other, field):
                raise ValueError(f"{field} differs between the tree's and the controller's CacheInitParams")
        if self.page_size != other.page_size:
            raise ValueError(f"page_size differs: {self.page_size} (tree) != {other.page_size} (controller)")
        if self.parallel_coords != other.parallel_coords:
            raise ValueError(
                f"parallel coordinates differ: {self.parallel_coords} (tree) != {other.parallel_coords} (controller)"
            )
