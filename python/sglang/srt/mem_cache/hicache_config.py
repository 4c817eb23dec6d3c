"""HiCacheConfig: the L1<->L2 settings of a HiCache stack (the ``--hicache-*`` flags).

Parallel coordinates are NOT here: they live in ``CacheInitParams`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend


class WritePolicy(str, Enum):
    """When a device node gets a host copy.

    ``write_through``: on its first insert. ``write_through_selective``: on its second insert
    (a prefix seen twice). ``write_back``: only when it is evicted from the device.
    """

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @classmethod
    def parse(cls, value: "str | WritePolicy") -> "WritePolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown write policy {value!r}; allowed: {', '.join(m.value for m in cls)}") from None

    @property
    def backup_threshold(self) -> int | None:
        """Inserts through a node after which it is backed up; None: only on eviction."""
        return _THRESHOLD[self]


_THRESHOLD = {
    WritePolicy.WRITE_THROUGH: 1,
    WritePolicy.WRITE_THROUGH_SELECTIVE: 2,
    WritePolicy.WRITE_BACK: None,
}


@dataclass
class HiCacheConfig:
    """Host tier settings.

    ``hicache_ratio``: host slots per device slot (used when ``hicache_size_gb`` is 0).
    ``hicache_size_gb``: host pool size in GB (split over the pools of a hybrid stack in
    proportion to their bytes per token). ``io_backend``: None picks ``kernel`` on CUDA and
    ``direct`` elsewhere. ``load_back_threshold``: host hits shorter than this many tokens are
    recomputed instead of loaded.
    """

    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0
    mem_layout: HostLayout | str = HostLayout.LAYER_FIRST
    io_backend: IOBackend | str | None = None
    load_back_threshold: int = 0

    def __post_init__(self):
        self.write_policy = WritePolicy.parse(self.write_policy)
        self.mem_layout = HostLayout.parse(self.mem_layout)
        if self.io_backend is not None:
            self.io_backend = IOBackend.parse(self.io_backend)
        if self.hicache_size_gb < 0:
            raise ValueError(f"hicache_size_gb must be >= 0, got {self.hicache_size_gb}")
        if self.hicache_size_gb == 0 and self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0 when hicache_size_gb is 0, got {self.hicache_ratio}")
        if self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0, got {self.load_back_threshold}")
