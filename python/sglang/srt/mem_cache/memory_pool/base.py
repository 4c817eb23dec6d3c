"""Device (L1) pool base: named components, each one contiguous layer-major tensor.

Every device pool stores each component (K, V, a latent, a Mamba state, an indexer key, ...) as
one tensor shaped ``(layer_num, size + page_size, *item_shape)``. The first page of slots is
reserved as a padding target, so usable slots are ``[page_size, size + page_size)``. Per-layer
buffers are views into that tensor, which lets a copy kernel address every layer from one base
pointer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch


class PoolKind(str, Enum):
    MHA = "mha"
    MLA = "mla"
    ASYMMETRIC_MHA = "asymmetric_mha"
    MAMBA = "mamba"
    DSA_INDEXER = "dsa_indexer"
    DSV4_ANCHOR = "dsv4_anchor"
    DSV4_STATE = "dsv4_state"


class ShardMode(str, Enum):
    """Whether TP ranks hold the same bytes for a page (replicated) or different ones (sharded)."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


# Which pool kinds hold identical bytes on every TP rank. MLA's latent, the DSA indexer key and
# the DeepSeek-V4 anchor/state are not split by heads; MHA heads and Mamba states are.
SHARD_MODE = {
    PoolKind.MHA: ShardMode.SHARDED,
    PoolKind.ASYMMETRIC_MHA: ShardMode.SHARDED,
    PoolKind.MAMBA: ShardMode.SHARDED,
    PoolKind.MLA: ShardMode.REPLICATED,
    PoolKind.DSA_INDEXER: ShardMode.REPLICATED,
    PoolKind.DSV4_ANCHOR: ShardMode.REPLICATED,
    PoolKind.DSV4_STATE: ShardMode.REPLICATED,
}

def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the bytes are stored as: fp8 lives in uint8 so indexing works on every device."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.uint8
    return dtype


@dataclass(frozen=True)
class KVComponent:
    """One per-layer buffer of a pool: ``item_shape`` elements of ``dtype`` per slot per layer."""

    name: str
    dtype: torch.dtype
    item_shape: tuple[int, ...]

    def __post_init__(self):
        if not self.item_shape or any(int(d) < 1 for d in self.item_shape):
            raise ValueError(f"component {self.name!r}: item_shape must be positive dims, got {self.item_shape}")

    @property
    def item_numel(self) -> int:
        return math.prod(self.item_shape)

    @property
    def item_bytes(self) -> int:
        return self.item_numel * self.dtype.itemsize


class KVCache:
    """A device pool: components of per-slot items for ``layer_num`` layers.

    ``size`` is the number of usable slots (tokens, or requests for state pools), a multiple of
    ``page_size``. Only ``kvcacheio`` routines, host pools and transfer code touch the bytes.
    """

    kind: PoolKind

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        components: tuple[KVComponent, ...],
        device: str | torch.device = "cpu",
        start_layer: int = 0,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size must be a positive multiple of page_size {page_size}, got {size}")
        if layer_num < 1:
            raise ValueError(f"layer_num must be >= 1, got {layer_num}")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate component names: {names}")
        self.size = size
        self.page_size = page_size
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num
        self.device = torch.device(device)
        self.components = tuple(components)
        self.buffers: dict[str, torch.Tensor] = {
            c.name: torch.zeros(
                (layer_num, self.total_slots, *c.item_shape), dtype=storage_dtype(c.dtype), device=self.device
            )
            for c in components
        }
        self.layer_transfer_counter = None

    @property
    def total_slots(self) -> int:
        return self.size + self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.components[0].dtype if self.components else torch.uint8

    def component(self, name: str) -> KVComponent:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"{type(self).__name__} has no component {name!r}; has {[c.name for c in self.components]}")

    def get_size_per_token(self) -> int:
        """Bytes per slot over all components and layers."""
        return sum(c.item_bytes for c in self.components) * self.layer_num

    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def register_layer_transfer_counter(self, counter) -> None:
        """Attach a LayerDoneCounter: layer reads then wait until that layer has loaded."""
        self.layer_transfer_counter = counter

    def _wait_layer(self, layer_id: int) -> int:
        local = layer_id - self.start_layer
        if not 0 <= local < self.layer_num:
            raise ValueError(f"layer_id {layer_id} outside [{self.start_layer}, {self.end_layer})")
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local)
        return local

    def layer_view(self, name: str, layer_id: int) -> torch.Tensor:
        """Component ``name`` of absolute layer ``layer_id``, viewed in its logical dtype."""
        buf = self.buffers[name][self._wait_layer(layer_id)]
        dtype = self.component(name).dtype
        return buf if buf.dtype == dtype else buf.view(dtype)

    def write_layer(self, name: str, layer_id: int, loc: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``value`` (shape (len(loc), *item_shape)) at slots ``loc`` of one layer."""
        local = layer_id - self.start_layer
        buf = self.buffers[name][local]
        comp = self.component(name)
        value = value.to(comp.dtype)
        if buf.dtype != comp.dtype:
            value = value.view(buf.dtype)
        buf[loc.to(buf.device)] = value.reshape(-1, *comp.item_shape).to(buf.device)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data_ptrs, data_lens, item_lens) of every per-layer buffer, component-major.

        Used by PD transfer to register memory: an item is one slot of one layer.
        """
        ptrs, lens, item_lens = [], [], []
        for comp in self.components:
            buf = self.buffers[comp.name]
            for layer in range(self.layer_num):
                view = buf[layer]
                ptrs.append(view.data_ptr())
                lens.append(view.numel() * view.element_size())
                item_lens.append(comp.item_bytes)
        return ptrs, lens, item_lens

    def clear(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()
