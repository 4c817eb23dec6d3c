"""What a host pool looks like to storage: its byte format, components and host memory.

Two kinds of pool register with a backend:

* this fork's host pools (``pool_host/``): they state their ``kind``, ``page_format`` and
  ``components``; every page lives in ``get_host_buffers()`` at the addresses
  ``get_page_buffer_meta`` gives, so backends move it straight from host memory.
* upstream-style pools (an upstream contributor's test double, an out-of-tree pool), which offer
  only upstream's ``HostKVCache`` surface: ``page_size``, ``get_dummy_flat_data_page()``,
  ``get_data_page(index, flat=True)``, ``set_from_flat_data_page(index, page)`` and, optionally,
  ``get_page_buffer_meta`` with the buffers it points into (``kv_buffer`` under a page-first
  ``layout``, or ``get_hybrid_pool_buffer()``). Such a pool moves zero-copy when those are there
  (one object per meta chunk for NIXL, named as upstream names them: ``_k``/``_v``,
  ``_mamba_temporal``/``_mamba_conv_<i>``), else *staged*: through a copy of its flat page, read
  back with ``set_from_flat_data_page`` once verified.

The page format of an upstream-style pool names its flat page (dtype, element count), its
layout and whether it is staged, so the two ways of storing it never share a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, ShardMode
from sglang.srt.mem_cache.pool_host.group import PoolName

PAGE_FIRST_LAYOUTS = ("page_first", "page_first_direct")


@dataclass(frozen=True)
class SegmentShape:
    """One component of a host page: its object tag, payload bytes and meta chunks."""

    tag: str
    nbytes: int
    num_chunks: int


@dataclass
class PoolShape:
    page_format: str
    kv_dtype: str
    page_size: int
    size: int | None  # slots; None: unknown (the pool checks its own indices)
    segments: list[SegmentShape]  # per component, in get_page_buffer_meta order
    buffers: list[torch.Tensor] | None  # uint8 views of the memory pages live in; None: staged
    page_contiguous: bool  # one chunk per component and page (few descriptors per page)
    shard: ShardMode
    native: bool  # one of this fork's pools
    flat_dtype: torch.dtype | None = None  # staged pools: the dtype of the flat page

    @property
    def staged(self) -> bool:
        return self.buffers is None

    @property
    def page_num(self) -> int | None:
        return None if self.size is None else self.size // self.page_size


def pool_shape(host_pool, name: PoolName, is_mla_model: bool) -> PoolShape:
    """The shape of ``host_pool`` registered as ``name``; ``is_mla_model`` decides whether an
    upstream-style KV pool is replicated across TP ranks (this fork's pools say so by kind)."""
    if hasattr(host_pool, "components") and hasattr(host_pool, "kind"):
        return _native(host_pool)
    return _upstream_style(host_pool, PoolName(name), is_mla_model)


def _native(pool) -> PoolShape:
    from sglang.srt.mem_cache.storage.keys import component_tag

    comps = list(pool.components)
    chunks = pool.buffers_per_page() // len(comps) if comps else 0
    segments = [SegmentShape(component_tag(c.name), c.item_bytes * pool.layer_num * pool.page_size, chunks)
                for c in comps]
    return PoolShape(
        page_format=pool.page_format,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        page_size=pool.page_size,
        size=pool.size,
        segments=segments,
        buffers=list(pool.get_host_buffers()),
        page_contiguous=pool.layout.page_contiguous,
        shard=SHARD_MODE[pool.kind],
        native=True,
    )


def _upstream_style(pool, name: PoolName, is_mla_model: bool) -> PoolShape:
    for attr in ("page_size", "get_dummy_flat_data_page", "get_data_page", "set_from_flat_data_page"):
        if not hasattr(pool, attr):
            raise TypeError(f"host pool {type(pool).__name__} registered as {name.value!r} lacks {attr!r}; a host "
                            f"pool needs page_size, get_dummy_flat_data_page, get_data_page, set_from_flat_data_page")
    page_size = int(pool.page_size)
    if page_size < 1:
        raise ValueError(f"host pool {type(pool).__name__}: page_size must be >= 1, got {page_size}")
    flat = pool.get_dummy_flat_data_page()
    page_bytes = flat.numel() * flat.element_size()
    layout = getattr(pool, "layout", None)
    layout = layout if isinstance(layout, str) else getattr(layout, "value", None)
    shard = ShardMode.REPLICATED if name is PoolName.KV and is_mla_model else ShardMode.SHARDED
    size = getattr(pool, "size", None)
    buffers, sizes = _exposed_buffers(pool, name, layout)
    if buffers is not None and size is None and name is not PoolName.KV:
        size = buffers[0].shape[0]  # hybrid buffers hold one row per slot
    if buffers is not None and (size is None or sum(sizes) != page_bytes):
        buffers, sizes = None, []  # what the meta points at is not the flat page: staged
    if buffers is not None:
        segments = [SegmentShape(t, n, 1) for t, n in zip(_chunk_tags(name, len(sizes)), sizes)]
        buffers = [b.reshape(-1).view(torch.uint8) for b in buffers]
    else:
        segments = [SegmentShape("", page_bytes, 1)]
    dtype = str(flat.dtype).removeprefix("torch.")
    mode = "zc:" + ",".join(map(str, sizes)) if buffers is not None else "staged"
    return PoolShape(
        page_format=f"upstream/{layout or '-'}/{mode}/{dtype}x{flat.numel()}/P{page_size}",
        kv_dtype=dtype,
        page_size=page_size,
        size=None if size is None else int(size),
        segments=segments,
        buffers=buffers,
        page_contiguous=True,
        shard=shard,
        native=False,
        flat_dtype=None if buffers is not None else flat.dtype,
    )


def _exposed_buffers(pool, name: PoolName, layout: str | None) -> tuple[list | None, list[int]]:
    """(contiguous CPU buffers, chunk byte sizes of page 0) when ``pool`` exposes its pages the
    way upstream's zero-copy paths use them; (None, []) otherwise."""
    if not hasattr(pool, "get_page_buffer_meta"):
        return None, []
    if name is PoolName.KV:
        kv = getattr(pool, "kv_buffer", None)
        buffers = [kv] if isinstance(kv, torch.Tensor) and layout in PAGE_FIRST_LAYOUTS else None
    else:
        getter = getattr(pool, "get_hybrid_pool_buffer", None)
        buffers = list(getter()) if callable(getter) else None
    if not buffers or not all(b.device.type == "cpu" and b.is_contiguous() for b in buffers):
        return None, []
    try:
        _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
    except (IndexError, ValueError, RuntimeError):
        return None, []
    return buffers, [int(s) for s in sizes]


def _chunk_tags(name: PoolName, n: int) -> list[str]:
    """Object tags of an upstream-style zero-copy pool's chunks, as upstream names them."""
    if name is PoolName.MAMBA:
        return ["temporal"] + [f"conv_{i}" for i in range(n - 1)]
    if n == 2:
        return ["k", "v"]
    if n == 1:
        return ["k" if name is PoolName.KV else ""]
    return [str(i) for i in range(n)]
