"""What a copy routine is given: one component's host and device tensors and their addressing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang.srt.mem_cache.pool_host.layout import HostLayout, ItemMap


@dataclass(frozen=True)
class ComponentIO:
    """One component of a pool pair.

    ``host`` is shaped by the layout (see ``pool_host/layout.py``), ``device`` is
    (layer_num, total_slots, *item_shape); both hold the same storage dtype. Maps are in elements.
    ``views`` is a cache of the copy routines (mutated by them), not part of the pair's identity.
    """

    host: torch.Tensor
    device: torch.Tensor
    host_map: ItemMap
    device_map: ItemMap
    layout: HostLayout
    page_size: int
    # Strided page views of host / device built by the direct routine, reused by every job on
    # this pair (a view call in a lane job is a GIL hand-off); lives and dies with the pair.
    views: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def layer_num(self) -> int:
        return self.device.shape[0]
