"""Settings of one ModelRunner (one TP rank of one pipeline stage), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.model_executor.model_config import DTYPES
from sglang.srt.model_executor.model_loader import LoadFormat
from sglang.srt.model_executor.state_pool_size import DEFAULT_MAMBA_FULL_MEMORY_RATIO, StatePoolSize

DEVICE_TYPES = ("cpu", "cuda")


@dataclass
class ModelRunnerConfig:
    model_path: str
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1  # pipeline stages (--pp-size); the world is tp_size x pp_size ranks
    pp_rank: int = 0
    attn_cp_size: int = 1  # attention context parallelism (--attn-cp-size); not combined with pp_size > 1
    attn_cp_rank: int = 0
    dist_init_method: str | None = None  # e.g. "tcp://127.0.0.1:29500"; needed when tp_size x pp_size > 1
    page_size: int = 1
    max_total_tokens: int | None = None  # device KV slots; None: mem_fraction_static of free memory
    mem_fraction_static: float = 0.8
    max_running_requests: int = 256  # rows of ReqToTokenPool
    context_length: int | None = None  # None: the config's max_position_embeddings
    seed: int = 0  # weights of load_format="dummy"
    # state models: slots of the state pool (state_pool_size.py; upstream's flags)
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO
    disable_radix_cache: bool = False  # no prefix cache: the state pool holds running requests only

    def __post_init__(self):
        LoadFormat.parse(self.load_format)
        if self.device.split(":")[0] not in DEVICE_TYPES:
            raise ValueError(f"device {self.device!r} is not supported; supported: {list(DEVICE_TYPES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {['auto', *DTYPES]}")
        checks = [
            ("tp_size", self.tp_size >= 1, ">= 1"),
            ("tp_rank", 0 <= self.tp_rank < self.tp_size, f"in [0, tp_size={self.tp_size})"),
            ("pp_size", self.pp_size >= 1, ">= 1"),
            ("pp_rank", 0 <= self.pp_rank < self.pp_size, f"in [0, pp_size={self.pp_size})"),
            ("attn_cp_size", self.attn_cp_size >= 1 and (self.attn_cp_size == 1 or self.pp_size == 1),
             ">= 1, and 1 with pp_size > 1"),
            ("attn_cp_rank", 0 <= self.attn_cp_rank < self.attn_cp_size, f"in [0, attn_cp_size={self.attn_cp_size})"),
            ("page_size", self.page_size >= 1, ">= 1"),
            ("max_total_tokens", self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"None or >= page_size={self.page_size}"),
            ("mem_fraction_static", 0 < self.mem_fraction_static <= 1, "in (0, 1]"),
            ("max_running_requests", self.max_running_requests >= 1, ">= 1"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; must be {allowed}")
        StatePoolSize(self.max_running_requests, self.max_mamba_cache_size, self.mamba_full_memory_ratio)  # checks
        if self.world_size > 1 and not self.dist_init_method:
            raise ValueError("dist_init_method (e.g. 'tcp://127.0.0.1:29500') is required when tp_size x pp_size > 1")

    @property
    def state_pool_size(self) -> StatePoolSize:
        return StatePoolSize(self.max_running_requests, self.max_mamba_cache_size, self.mamba_full_memory_ratio,
                             prefix_cache=not self.disable_radix_cache)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.attn_cp_size

    @property
    def rank(self) -> int:
        """Global rank: ``pp_rank * tp_size + tp_rank`` (upstream's order); under attention
        context parallelism ``attn_cp_rank * tp_size + tp_rank``."""
        return (self.pp_rank * self.attn_cp_size + self.attn_cp_rank) * self.tp_size + self.tp_rank
