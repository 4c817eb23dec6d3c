"""Mamba / linear-attention state pool: one slot per request, conv states + a temporal state."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.allocator import PagedAllocator
from sglang.srt.mem_cache.memory_pool.base import KVCache, KVComponent, PoolKind


class MambaPool(KVCache):
    """Per request slot and Mamba layer: a temporal (SSM) state and one or more conv states.

    Slots are requests, not tokens: page_size is 1 and the pool owns its allocator.
    Components: ``temporal`` then ``conv_0``, ``conv_1``, ...
    ``conv_state_segments[i]``: rows of dim 0 of conv state i that are TP-sharded separately (a
    rank's q, k and v channels, each a contiguous slice of the model's); default one segment.
    PD transfer cuts and joins states across TP sizes by these (``row_segments``).
    """

    kind = PoolKind.MAMBA

    def __init__(
        self,
        size: int,
        conv_state_shapes: list[tuple[int, ...]],
        temporal_state_shape: tuple[int, ...],
        num_mamba_layers: int,
        conv_dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: torch.dtype = torch.float32,
        device="cpu",
        conv_state_segments: list[tuple[int, ...]] | None = None,
    ):
        if not conv_state_shapes:
            raise ValueError("MambaPool needs at least one conv state shape")
        segments = conv_state_segments or [(shape[0],) for shape in conv_state_shapes]
        if len(segments) != len(conv_state_shapes) or any(
                sum(seg) != shape[0] or min(seg) < 1 for seg, shape in zip(segments, conv_state_shapes)):
            raise ValueError(f"conv_state_segments {conv_state_segments} must split dim 0 of each conv state "
                             f"shape {conv_state_shapes} into positive row counts")
        components = (KVComponent("temporal", ssm_dtype, tuple(temporal_state_shape)),) + tuple(
            KVComponent(f"conv_{i}", conv_dtype, tuple(shape)) for i, shape in enumerate(conv_state_shapes)
        )
        super().__init__(size, 1, num_mamba_layers, components, device)
        self.num_conv = len(conv_state_shapes)
        # component -> rows of dim 0 per TP-sharded segment
        self.row_segments = {"temporal": (temporal_state_shape[0],),
                             **{f"conv_{i}": tuple(seg) for i, seg in enumerate(segments)}}
        self.allocator = PagedAllocator(size, 1, reserved_pages=1)

    @property
    def temporal(self) -> torch.Tensor:
        return self.buffers["temporal"]

    @property
    def conv(self) -> list[torch.Tensor]:
        return [self.buffers[f"conv_{i}"] for i in range(self.num_conv)]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def free(self, indices, trusted: bool = False) -> None:
        self.allocator.free(indices, trusted=trusted)

    def available_size(self) -> int:
        return self.allocator.available_size()
