"""What a copy routine is given: one component's host and device tensors and their addressing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.pool_host.layout import HostLayout, ItemMap


@dataclass(frozen=True)
class ComponentIO:
    """One component of a pool pair.

    ``host`` is shaped by the layout (see ``pool_host/layout.py``), ``device`` is
    (layer_num, total_slots, *item_shape); both hold the same storage dtype. Maps are in elements.
    """

    host: torch.Tensor
    device: torch.Tensor
    host_map: ItemMap
    device_map: ItemMap
    layout: HostLayout
    page_size: int

    @property
    def layer_num(self) -> int:
        return self.device.shape[0]
