"""Device pools with real-model geometry (pages of >= 2 KiB per layer), and a pure-torch
reference view of host buffers, for the IO tests that must exercise the large-range paths.

Bytes per (page, layer) of each component are in the comments. Few pages, several layers.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE
from sglang.srt.mem_cache.memory_pool import (
    AsymmetricMHATokenToKVPool,
    DeepSeekV4StatePool,
    DSAIndexerPool,
    KVCache,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PoolKind,
)
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.test.kv_pools import FP8, make_host_pool, randomize_pools

BF16 = torch.bfloat16
MLA_DTYPE = FP8 if FP8 is not None else BF16  # fp8 latents are stored as uint8

_REAL = {
    # Llama-3-8B per TP rank: 8 KV heads x 128, page 16: K 32 KiB, V 32 KiB
    PoolKind.MHA: lambda d: MHATokenToKVPool(8 * 16, 16, BF16, 8, 128, 4, d),
    # K heads 192 wide, V heads 128 wide, page 16: K 24 KiB, V 16 KiB
    PoolKind.ASYMMETRIC_MHA: lambda d: AsymmetricMHATokenToKVPool(8 * 16, 16, BF16, 4, 192, 128, 4, d),
    # DeepSeek-V3: kv_lora_rank 512 + rope 64, page 16: 9 KiB (fp8) or 18 KiB (bf16)
    PoolKind.MLA: lambda d: MLATokenToKVPool(8 * 16, 16, MLA_DTYPE, 512, 64, 4, d),
    # one request per slot: temporal fp32 (8, 64, 16) = 32 KiB, conv (3, 1024) bf16 = 6 KiB,
    # conv (3, 256) bf16 = 1.5 KiB (below 2 KiB: the row path, in the same pool)
    PoolKind.MAMBA: lambda d: MambaPool(8, [(3, 1024), (3, 256)], (8, 64, 16), 3, conv_dtype=BF16, device=d),
    # index keys 128 x bf16, page 64: 16 KiB; fp32 scales: 256 B (row path)
    PoolKind.DSA_INDEXER: lambda d: DSAIndexerPool(8 * 64, 64, 128, 3, BF16, d),
    # compressed rows 512 x bf16, page 16: 16 KiB
    PoolKind.DSV4_STATE: lambda d: DeepSeekV4StatePool(8 * 16, 16, 512, 3, BF16, d),
}
REAL_KINDS = tuple(_REAL)

# pages used by the tests: a run of three consecutive pages on every side (merged ranges in
# layer_first), then singles out of order. Device page 0 is the padding page (8 usable pages);
# a host pool at ratio 2 holds 16 pages.
HOST_PAGES = [9, 10, 11, 2, 14]
SRC_PAGES = [1, 2, 3, 7, 5]
DST_PAGES = [4, 5, 6, 1, 8]


def make_real_pool(kind: PoolKind, device="cpu") -> KVCache:
    return _REAL[kind](device)


def slots(pages, page_size: int) -> torch.Tensor:
    """Every slot of ``pages`` (page numbers), page by page."""
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64)


def to_logical(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """A host buffer as (layer, slot, *item), through its layout's logical shape (a view where
    the layout allows, else a copy): the reference the copy routines are judged against."""
    if layout is HostLayout.LAYER_FIRST:  # (L, S, *item)
        return data
    if layout is HostLayout.PAGE_FIRST:  # (S, L, *item)
        return data.transpose(0, 1)
    if layout is HostLayout.PAGE_FIRST_DIRECT:  # (Np, L, P, *item)
        pages, layers, P, *item = data.shape
        return data.transpose(0, 1).reshape(layers, pages * P, *item)
    pages, heads, P, layers, *rest = data.shape  # page_head: (Np, H, P, L, *rest)
    return data.permute(3, 0, 2, 1, *range(4, data.dim())).reshape(layers, pages * P, heads, *rest)


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (on its device), last dim widened to bytes."""
    return t.contiguous().view(torch.uint8)


def table_cells(io: IOBackend, routine) -> tuple[list, list[str]]:
    """The (kind, layout) cells of the IO table that ``io`` serves with ``routine``, sorted,
    and their pytest ids."""
    cells = sorted(((kind, layout) for (kind, layout, cell_io), r in IO_TABLE.items()
                    if cell_io is io and r is routine), key=lambda c: (c[0].value, c[1].value))
    return cells, [f"{k.value}-{lay.value}" for k, lay in cells]


def randomized_real_pools(kind: PoolKind, layout: HostLayout, io: str = "direct", device="cpu", seed: int = 0):
    """(src, dst, host, host_slots, src_slots, dst_slots): two real-geometry device pools and a
    host pool, every byte random; slots of HOST_PAGES / SRC_PAGES / DST_PAGES."""
    gen = torch.Generator().manual_seed(seed)
    src, dst = make_real_pool(kind, device), make_real_pool(kind, device)
    host = make_host_pool(src, layout, io)
    randomize_pools(gen, host, src, dst)
    if device != "cpu":
        torch.cuda.synchronize()
    P = host.page_size
    return src, dst, host, slots(HOST_PAGES, P), slots(SRC_PAGES, P), slots(DST_PAGES, P)
