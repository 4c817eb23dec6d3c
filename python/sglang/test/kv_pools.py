"""Test helpers: build a device + host pool of any kind, and a per-item reference of the layouts.

The reference addresses one item (slot, layer) of one component through the logical shape of
each layout, independently of ``ItemMap`` and of every copy routine, so it can judge them.
"""

from __future__ import annotations

import os

import torch

from sglang.srt.mem_cache.memory_pool import (
    AsymmetricMHATokenToKVPool,
    DeepSeekV4StatePool,
    DSAIndexerPool,
    KVCache,
    LogicalAnchorPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PoolKind,
)
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.layout import HostLayout
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

HOST_CLASSES = {
    PoolKind.MHA: MHATokenToKVPoolHost,
    PoolKind.MLA: MLATokenToKVPoolHost,
    PoolKind.ASYMMETRIC_MHA: AsymmetricMHATokenToKVPoolHost,
    PoolKind.MAMBA: MambaPoolHost,
    PoolKind.DSA_INDEXER: DSAIndexerPoolHost,
    PoolKind.DSV4_ANCHOR: LogicalHostPool,
    PoolKind.DSV4_STATE: DeepSeekV4StateHostPool,
}

FP8 = getattr(torch, "float8_e4m3fn", None)
KV_DTYPES = [torch.float16, torch.bfloat16, torch.float32] + ([FP8] if FP8 is not None else [])


def suite_device() -> str:
    """Device the suite runs on: ``SGLANG_TEST_DEVICE`` (set by run_suite.py), default cpu.

    A CUDA suite on a machine without CUDA is an error, not a silent CPU run.
    """
    device = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("SGLANG_TEST_DEVICE=cuda but CUDA is not available")
    return device


def make_device_pool(
    kind: PoolKind, dtype=torch.bfloat16, page_size: int = 4, num_pages: int = 8, layer_num: int = 2, device="cpu"
) -> KVCache:
    """A small device pool of ``kind``: ``num_pages`` usable pages (Mamba: slots, page_size 1)."""
    size = num_pages * page_size
    if kind is PoolKind.MHA:
        return MHATokenToKVPool(size, page_size, dtype, 2, 8, layer_num, device)
    if kind is PoolKind.MLA:
        return MLATokenToKVPool(size, page_size, dtype, 8, 4, layer_num, device)
    if kind is PoolKind.ASYMMETRIC_MHA:
        return AsymmetricMHATokenToKVPool(size, page_size, dtype, 2, 8, 4, layer_num, device)
    if kind is PoolKind.MAMBA:
        return MambaPool(num_pages, [(3, 4), (2, 6)], (2, 4, 2), layer_num, conv_dtype=dtype, device=device)
    if kind is PoolKind.DSA_INDEXER:
        return DSAIndexerPool(size, page_size, 8, layer_num, dtype, device)
    if kind is PoolKind.DSV4_ANCHOR:
        return LogicalAnchorPool(size, page_size, layer_num, device)
    if kind is PoolKind.DSV4_STATE:
        return DeepSeekV4StatePool(size, page_size, 12, layer_num, dtype, device)
    raise ValueError(f"unknown kind {kind}")


def make_host_pool(device_pool: KVCache, layout, io_backend, ratio: float = 2.0, size: int | None = None, **kwargs):
    """A host pool of ``device_pool``'s kind: ``ratio`` times its slots, or ``size`` slots.

    Each kind through its own (upstream's) constructor: the DSA indexer sized by a logical anchor
    of that size, the V4 pools by slots and pages; the others mirror ``device_pool`` directly.
    """
    kind, P = device_pool.kind, device_pool.page_size
    slots = size if size is not None else int(device_pool.size * ratio) // P * P
    if kind is PoolKind.DSV4_ANCHOR:
        return LogicalHostPool(slots, P, layout, io_backend=io_backend)
    if kind is PoolKind.DSV4_STATE:
        return DeepSeekV4StateHostPool("dsv4_state", [device_pool], slots // P, P, layout, io_backend=io_backend, **kwargs)
    if kind is PoolKind.DSA_INDEXER:
        anchor = LogicalHostPool(slots, P)  # only its size and page size matter to the sidecar
        return DSAIndexerPoolHost(device_pool, anchor, layout, io_backend=io_backend, **kwargs)
    return HOST_CLASSES[kind](device_pool, ratio, layout=layout, io_backend=io_backend, size=size, **kwargs)


def randomize_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill ``t`` with random bytes (any dtype; NaN patterns included, so compare bytes)."""
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(b.device))


def randomize_pools(gen: torch.Generator, host, *device_pools) -> None:
    """Every byte of ``device_pools`` (in order), then of each of ``host``'s components, random."""
    for pool in device_pools:
        for buf in pool.buffers.values():
            randomize_bytes(buf, gen)
    for comp in host.components:
        randomize_bytes(host.host_buffer(comp.name), gen)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def host_item(host_pool, name: str, slot: int, layer: int) -> torch.Tensor:
    """The item (slot, layer) of component ``name`` addressed through the layout's logical shape."""
    data = host_pool.host_buffer(name)
    P = host_pool.page_size
    layout = host_pool.layout
    if layout is HostLayout.LAYER_FIRST:
        return data[layer, slot]
    if layout is HostLayout.PAGE_FIRST:
        return data[slot, layer]
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        return data[slot // P, layer, slot % P]
    return data[slot // P, :, slot % P, layer]  # page_head: (H, D)
