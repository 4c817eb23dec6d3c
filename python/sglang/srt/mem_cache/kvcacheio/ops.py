"""sgl-kernel's ``kvcacheio`` ops (the calls upstream's host pools make), on our copy routines.

Upstream's host pools call ``sgl_kernel.kvcacheio`` with byte geometry (``item_size``,
``src_layout_dim``: bytes of one token of one layer, and of one token over all layers) and with
per-layer device tensors or a table of their addresses. These functions take the same names
and keywords and run on the routines behind the IO table's cells: the Triton copy kernel (or its
torch stand-in) for ``kernel``, byte-range copies for ``direct``. Geometry they cannot serve
raises ValueError before any byte moves.

Device tensors here are one layer each, ``(num_slots, *item)`` with rows ``stride(0)`` apart;
host tensors are ``page_first`` ``(num_slots, layer_num, *item)`` or ``page_first_direct``
``(num_pages, layer_num, page_size, *item)``. Index arguments are token slots.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sglang.srt.mem_cache.kvcacheio import direct, kernel
from sglang.srt.mem_cache.pool_host.layout import HostLayout, ItemMap, host_item_map


def _elems(nbytes: int, t: torch.Tensor, what: str) -> int:
    e = t.element_size()
    if nbytes <= 0 or nbytes % e:
        raise ValueError(f"{what} is {nbytes} bytes: not a positive multiple of the {e}-byte element")
    return nbytes // e


def _token_rows(row: int, item: int, layer_stride: int = 0, page_size: int = 1) -> ItemMap:
    """Tokens ``row`` elements apart (pages of ``page_size`` of them), ``item`` elements each,
    layers ``layer_stride`` apart."""
    return ItemMap(page_size, page_size * row, layer_stride, row, item, item, 1)


def _device_layer_map(t: torch.Tensor, page_size: int = 1, layer_stride: int = 0) -> ItemMap:
    if t.stride(-1) != 1 or (t.dim() > 1 and not t[0].is_contiguous()):
        raise ValueError(f"device layer tensor must have packed rows, got strides {t.stride()}")
    return _token_rows(t.stride(0), math.prod(t.shape[1:]), layer_stride, page_size)


def _pfd_map(t: torch.Tensor, page_size: int) -> ItemMap:
    """Addressing of a ``page_first_direct`` host tensor (num_pages, layer_num, page_size, *item)."""
    if t.dim() < 4 or t.shape[2] != page_size or not t.is_contiguous():
        raise ValueError(f"page_first_direct tensor must be contiguous (pages, layers, {page_size}, ...), "
                         f"got shape {tuple(t.shape)}")
    return host_item_map(HostLayout.PAGE_FIRST_DIRECT, t.shape[0] * page_size, t.shape[1], page_size, tuple(t.shape[3:]))


def _cpu(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64)


# ---- kernel: page_first host, one buffer per call (MLA; each side of an asymmetric K/V) -------------
def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """Host ``page_first`` ``src`` -> device layer ``dst`` for layer ``layer_id``."""
    item = _elems(item_size, src, "item_size")
    src_map = _token_rows(_elems(src_layout_dim, src, "src_layout_dim"), item, layer_stride=item)
    dst_map = _device_layer_map(dst)
    if dst_map.chunk_numel != item:
        raise ValueError(f"device rows hold {dst_map.chunk_numel} elements, item_size says {item}")
    kernel.copy_fn(dst.device)(src, dst, src_map, dst_map, src_indices, dst_indices, layer_id, 1)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """Device layers (``src_layers``: a uint64 table of their addresses, rows ``item_size``
    apart) -> host ``page_first`` ``dst``, every layer."""
    if src_layers.dtype not in (torch.uint64, torch.int64) or src_layers.numel() < num_layers:
        raise ValueError(f"src_layers must hold {num_layers} uint64 addresses, got {src_layers.dtype} "
                         f"x {src_layers.numel()}")
    item = _elems(item_size, dst, "item_size")
    src_map = _token_rows(item, item)
    dst_map = _token_rows(_elems(dst_layout_dim, dst, "dst_layout_dim"), item, layer_stride=item)
    kernel.table_copy_fn(src_layers.device)(src_layers, dst, src_map, dst_map, src_indices, dst_indices, 0, num_layers)


def can_use_write_back_jit_kernel(*, element_size: int) -> bool:
    """Whether the staged write-back serves items of ``element_size`` bytes: the Triton kernel
    moves any whole number of bytes."""
    return element_size > 0


def transfer_hicache_all_layer_mla_staged_lf_pf(
    ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
    *,
    page_size: int,
) -> None:
    """Device layers (address table ``ptr_src``) -> host ``page_first`` ``dst`` through
    ``staging`` (a device tensor shaped like ``dst``'s first rows): each chunk of whole pages is
    gathered into staging by the kernel, then moves to the host one page per row."""
    if staging.shape[1:] != dst.shape[1:] or staging.dtype != dst.dtype:
        raise ValueError(f"staging {tuple(staging.shape)} {staging.dtype} does not match host rows "
                         f"{tuple(dst.shape)} {dst.dtype}")
    capacity = staging.shape[0] - staging.shape[0] % page_size
    if capacity == 0:
        raise ValueError(f"staging holds {staging.shape[0]} tokens, less than one page of {page_size}")
    staging = staging[:capacity]
    layers, item = dst.shape[1], math.prod(dst.shape[2:])
    token = layers * item  # elements of one token over all layers
    src_map, stage_map = _token_rows(item, item), _token_rows(token, item, layer_stride=item)
    gather = kernel.table_copy_fn(ptr_src.device)
    host_pages = _cpu(dst_indices)[::page_size]
    seg = page_size * token * dst.element_size()
    n = src_indices.numel()
    for lo in range(0, n, capacity):
        k = min(capacity, n - lo)
        stage_slots = torch.arange(k, device=staging.device)
        gather(ptr_src, staging, src_map, stage_map, src_indices[lo : lo + k], stage_slots, 0, layers)
        pages = host_pages[lo // page_size : (lo + k) // page_size]
        stage_off = torch.arange(pages.numel(), dtype=torch.int64) * seg
        direct.copy_rows(staging, dst, stage_off, pages * (token * dst.element_size()), seg)


# ---- direct: page_first_direct host, one call per buffer list -------------------------------------
def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host ``page_first_direct`` buffers -> their device layers, layer ``layer_id``, by page."""
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} host buffers for {len(dst_ptrs)} device layers")
    src_idx, dst_idx = _cpu(src_indices), _cpu(dst_indices)
    for src, dst in zip(src_ptrs, dst_ptrs):
        direct.copy_pages(src, dst, _pfd_map(src, page_size), _device_layer_map(dst, page_size), src_idx, dst_idx,
                          range(layer_id, layer_id + 1))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layers -> host ``page_first_direct`` buffers, every layer: ``src_ptrs`` lists each
    buffer's layers in turn (``dst_ptrs[i]`` takes ``src_ptrs[i * L : (i + 1) * L]``)."""
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} device layers do not split over {len(dst_ptrs)} host buffers")
    per_dst = len(src_ptrs) // len(dst_ptrs)
    src_idx, dst_idx = _cpu(src_indices), _cpu(dst_indices)
    for i, dst in enumerate(dst_ptrs):
        host_map = _pfd_map(dst, page_size)
        layers = list(src_ptrs[i * per_dst : (i + 1) * per_dst])
        if dst.shape[1] != per_dst:
            raise ValueError(f"host buffer {i} has {dst.shape[1]} layers, given {per_dst} device layers")
        stacked = _stacked(layers)
        if stacked is not None:  # one job over every layer, as the IO table's direct routine runs
            dev_map = _device_layer_map(layers[0], page_size, layer_stride=layers[0].numel())
            direct.copy_pages(stacked, dst, dev_map, host_map, src_idx, dst_idx, range(per_dst))
            continue
        for layer, src in enumerate(layers):
            direct.copy_pages(src, dst, _device_layer_map(src, page_size), host_map, src_idx, dst_idx,
                              range(layer, layer + 1))


def _stacked(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one contiguous (L, ...) tensor when they lie back to back in one storage."""
    first = layers[0]
    if not first.is_contiguous():
        return None
    nbytes = first.numel() * first.element_size()
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(layers):
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base or t.data_ptr() != first.data_ptr() + i * nbytes):
            return None
    return first.as_strided((len(layers), *first.shape), (first.numel(), *first.stride()))
