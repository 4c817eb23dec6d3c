"""Vectorised torch copy over ItemMaps: the ``kernel`` backend's stand-in where Triton cannot run.

Used for kernel-only layouts on a machine with neither a GPU nor TRITON_INTERPRET=1. It builds
an int64 offset per element, so it costs 8 extra bytes per element moved: correct, not fast.
"""

from __future__ import annotations

import ctypes

import torch

from sglang.srt.mem_cache.pool_host.layout import ItemMap


def _offsets(m: ItemMap, slots: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
    base = (slots // m.page_size) * m.page_stride + (slots % m.page_size) * m.token_stride
    chunk = torch.arange(m.num_chunks, dtype=torch.int64) * m.chunk_stride
    elem = torch.arange(m.chunk_numel, dtype=torch.int64)
    return (
        (layers * m.layer_stride)[:, None, None, None]
        + base[None, :, None, None]
        + chunk[None, None, :, None]
        + elem[None, None, None, :]
    ).reshape(-1)


def copy_items(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_map: ItemMap,
    dst_map: ItemMap,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layer_begin: int,
    num_layers: int,
) -> None:
    """Same contract as ``triton_kernels.copy_items``."""
    if src_slots.numel() == 0:
        return
    layers = torch.arange(layer_begin, layer_begin + num_layers, dtype=torch.int64)
    s_off = _offsets(src_map, src_slots.cpu(), layers).to(src.device)
    d_off = _offsets(dst_map, dst_slots.cpu(), layers).to(dst.device)
    dst.view(-1)[d_off] = src.view(-1)[s_off].to(dst.device)


def copy_items_from_table(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_map: ItemMap,
    dst_map: ItemMap,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layer_begin: int,
    num_layers: int,
) -> None:
    """Same contract as ``triton_kernels.copy_items_from_table``, for CPU sources only: each
    layer's address becomes a tensor over the bytes the copy reads."""
    if src_slots.numel() == 0:
        return
    if src_layers.device.type != "cpu":
        raise ValueError("the torch stand-in reads per-layer addresses of CPU memory only")
    slots = src_slots.cpu()
    extent = int(_offsets(src_map, slots, torch.zeros(1, dtype=torch.int64)).max()) + 1  # elements read
    addresses = src_layers.tolist()
    for layer in range(layer_begin, layer_begin + num_layers):
        raw = (ctypes.c_uint8 * (extent * dst.element_size())).from_address(int(addresses[layer]))
        src = torch.frombuffer(raw, dtype=torch.uint8).view(dst.dtype)
        _copy_layer(src, dst, src_map, dst_map, slots, dst_slots, layer)


def _copy_layer(src, dst, src_map, dst_map, src_slots, dst_slots, layer: int) -> None:
    """One layer of a table copy: ``src`` is that layer alone (layer offset 0 on its side)."""
    one = torch.tensor([layer], dtype=torch.int64)
    s_off = _offsets(src_map, src_slots, torch.zeros(1, dtype=torch.int64))
    d_off = _offsets(dst_map, dst_slots.cpu(), one).to(dst.device)
    dst.view(-1)[d_off] = src.view(-1)[s_off].to(dst.device)
