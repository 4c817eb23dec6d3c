"""Triton copy kernel shared by every (pool kind, layout) cell of the ``kernel`` backend.

One kernel moves items between any two buffers described by an :class:`ItemMap`: host layouts
and the layer-major device tensor alike. A program copies a block of tokens x one chunk of one
layer; the grid is (token blocks, layers, chunks). Bytes move as the widest integer word that
divides the chunk and both base addresses, so fp8/bf16/fp32 all copy bit-exactly.

Import this module only after deciding to use Triton: on CPU it needs TRITON_INTERPRET=1 set
before import (the interpreter runs each program instance in Python).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang.srt.mem_cache.pool_host.layout import ItemMap

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _copy_items_kernel(
    src_ptr,
    dst_ptr,
    src_slots_ptr,
    dst_slots_ptr,
    num_tokens,
    layer_begin,
    s_page_size,
    s_page_stride,
    s_layer_stride,
    s_token_stride,
    s_chunk_stride,
    d_page_size,
    d_page_stride,
    d_layer_stride,
    d_token_stride,
    d_chunk_stride,
    chunk_numel,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SRC_TABLE: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = (layer_begin + tl.program_id(1)).to(tl.int64)
    chunk = tl.program_id(2).to(tl.int64)
    tmask = tok < num_tokens
    ss = tl.load(src_slots_ptr + tok, mask=tmask, other=0).to(tl.int64)
    ds = tl.load(dst_slots_ptr + tok, mask=tmask, other=0).to(tl.int64)
    s_base = (
        (ss // s_page_size) * s_page_stride
        + layer * s_layer_stride
        + (ss % s_page_size) * s_token_stride
        + chunk * s_chunk_stride
    )
    d_base = (
        (ds // d_page_size) * d_page_stride
        + layer * d_layer_stride
        + (ds % d_page_size) * d_token_stride
        + chunk * d_chunk_stride
    )
    if SRC_TABLE:  # src_ptr holds one uint64 base address per layer (s_layer_stride is 0)
        src = tl.load(src_ptr + layer).to(tl.pointer_type(dst_ptr.dtype.element_ty))
    else:
        src = src_ptr
    for e0 in range(0, chunk_numel, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        mask = tmask[:, None] & (e < chunk_numel)[None, :]
        vals = tl.load(src + s_base[:, None] + e[None, :], mask=mask)
        tl.store(dst_ptr + d_base[:, None] + e[None, :], vals, mask=mask)


def _word_size(chunk_bytes: int, *tensors: torch.Tensor) -> int:
    for w in (8, 4, 2, 1):
        if chunk_bytes % w == 0 and all(t.data_ptr() % w == 0 for t in tensors):
            return w
    return 1


def _words(t: torch.Tensor, w: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1).view(_WORD_DTYPES[w])


def _in_words(m: ItemMap, elem_bytes: int, w: int) -> tuple[int, ...]:
    b = m.scaled(elem_bytes)
    return (m.page_size, b.page_stride // w, b.layer_stride // w, b.token_stride // w, b.chunk_stride // w)


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
    """Copy every chunk of ``num_layers`` layers from ``layer_begin`` for paired slots.

    ``src``/``dst`` are contiguous tensors of the same element size; maps are in their elements.
    """
    elem = src.element_size()
    w = _word_size(src_map.chunk_numel * elem, src, dst)
    _launch(_words(src, w), dst, w, elem, src_map, dst_map, src_slots, dst_slots, layer_begin, num_layers, False)


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
    """``copy_items`` from per-layer sources named by address: ``src_layers[l]`` (uint64, on the
    kernel's device) is where layer ``l`` starts, in ``dst``'s element type; ``src_map`` addresses
    within one layer (its layer_stride is ignored). Each address must be aligned to the word the
    chunk moves in (true of torch allocations and of whole-item offsets into them)."""
    elem = dst.element_size()
    w = _word_size(src_map.chunk_numel * elem, dst)
    src_map = ItemMap(src_map.page_size, src_map.page_stride, 0, src_map.token_stride, src_map.chunk_stride,
                      src_map.chunk_numel, src_map.num_chunks)
    _launch(src_layers, dst, w, elem, src_map, dst_map, src_slots, dst_slots, layer_begin, num_layers, True)


def _launch(src, dst, w, elem, src_map, dst_map, src_slots, dst_slots, layer_begin, num_layers, src_table) -> None:
    n = src_slots.numel()
    if n == 0:
        return
    gpu = dst.device if dst.is_cuda else src.device
    src_slots = src_slots.to(gpu, non_blocking=True)
    dst_slots = dst_slots.to(gpu, non_blocking=True)
    chunk_words = src_map.chunk_numel * elem // w
    block_e = triton.next_power_of_2(chunk_words)
    if _INTERPRETED:
        block_e = min(block_e, 4096)
        block_t = min(triton.next_power_of_2(n), max(1, 16384 // block_e), 256)
    else:
        block_e = min(block_e, 512)
        block_t = max(1, min(32, 2048 // block_e))
    grid = (triton.cdiv(n, block_t), num_layers, src_map.num_chunks)
    _copy_items_kernel[grid](
        src,
        _words(dst, w),
        src_slots,
        dst_slots,
        n,
        layer_begin,
        *_in_words(src_map, elem, w),
        *_in_words(dst_map, elem, w),
        chunk_words,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        SRC_TABLE=src_table,
    )
