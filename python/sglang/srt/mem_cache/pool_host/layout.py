"""Host layouts: buffer shapes, element addressing and the page byte format.

For a component with ``item_shape`` per slot per layer (MHA: (H, D)), S slots, Np = S / P pages
and L layers, the host buffer of that component is shaped:

=====================  =========================  =============================================
layout                 shape                      what it is for
=====================  =========================  =============================================
``layer_first``        (L, S, *item)              same order as the device; a page is L chunks
``page_first``         (S, L, *item)              a page is one contiguous run (kernel IO only)
``page_first_direct``  (Np, L, P, *item)          one contiguous (page, layer) run per copy
``page_head``          (Np, H, P, L, D)           head-major page, cut by head groups (MHA)
=====================  =========================  =============================================

Every item is addressed as ``chunks`` equal chunks (H for page_head, 1 otherwise), so one
formula serves every layout and the device side too (see :class:`ItemMap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang.srt.choice_enum import ChoiceEnum


class HostLayout(ChoiceEnum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"

    @property
    def page_contiguous(self) -> bool:
        """A page of one component is a single contiguous byte range."""
        return self is not HostLayout.LAYER_FIRST

    @property
    def page_format(self) -> str:
        """Byte order of a flat page within one component (part of the storage key namespace).

        Letters: L layer, P token in page, I whole item, H head, D head dim. ``layer_first`` and
        ``page_first_direct`` produce the same bytes, so they can share L3 pages.
        """
        return _PAGE_FORMAT[self]


_PAGE_FORMAT = {
    HostLayout.LAYER_FIRST: "LPI",
    HostLayout.PAGE_FIRST: "PLI",
    HostLayout.PAGE_FIRST_DIRECT: "LPI",
    HostLayout.PAGE_HEAD: "HPLD",
}


class IOBackend(ChoiceEnum):
    KERNEL = "kernel"
    DIRECT = "direct"

    @classmethod
    def label(cls) -> str:
        return "io_backend"


@dataclass(frozen=True)
class ItemMap:
    """Element offset of chunk ``c`` of slot ``s`` in layer ``l`` of one component buffer::

        (s // page_size) * page_stride + l * layer_stride + (s % page_size) * token_stride
            + c * chunk_stride + e          for e in [0, chunk_numel)
    """

    page_size: int
    page_stride: int
    layer_stride: int
    token_stride: int
    chunk_stride: int
    chunk_numel: int
    num_chunks: int

    def scaled(self, factor: int) -> "ItemMap":
        """The same map in units ``factor`` times smaller (e.g. elements -> bytes)."""
        return ItemMap(
            self.page_size,
            self.page_stride * factor,
            self.layer_stride * factor,
            self.token_stride * factor,
            self.chunk_stride * factor,
            self.chunk_numel * factor,
            self.num_chunks,
        )


def num_chunks(layout: HostLayout, item_shape: tuple[int, ...]) -> int:
    return item_shape[0] if layout is HostLayout.PAGE_HEAD else 1


def host_shape(
    layout: HostLayout, num_slots: int, layer_num: int, page_size: int, item_shape: tuple[int, ...]
) -> tuple[int, ...]:
    num_pages = num_slots // page_size
    if layout is HostLayout.LAYER_FIRST:
        return (layer_num, num_slots, *item_shape)
    if layout is HostLayout.PAGE_FIRST:
        return (num_slots, layer_num, *item_shape)
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        return (num_pages, layer_num, page_size, *item_shape)
    heads, rest = item_shape[0], item_shape[1:]
    return (num_pages, heads, page_size, layer_num, *rest)


def host_item_map(
    layout: HostLayout, num_slots: int, layer_num: int, page_size: int, item_shape: tuple[int, ...]
) -> ItemMap:
    """Element addressing of a host buffer (units: elements of the component dtype)."""
    item = math.prod(item_shape)
    chunks = num_chunks(layout, item_shape)
    chunk = item // chunks
    P, L = page_size, layer_num
    if layout is HostLayout.LAYER_FIRST:
        return ItemMap(P, P * item, num_slots * item, item, chunk, chunk, chunks)
    if layout is HostLayout.PAGE_FIRST:
        return ItemMap(P, P * L * item, item, L * item, chunk, chunk, chunks)
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        return ItemMap(P, L * P * item, P * item, item, chunk, chunk, chunks)
    return ItemMap(P, P * L * item, chunk, L * chunk, P * L * chunk, chunk, chunks)


def device_item_map(total_slots: int, page_size: int, item_shape: tuple[int, ...], chunks: int) -> ItemMap:
    """Addressing of a device component tensor (L, total_slots, *item), split into ``chunks``."""
    item = math.prod(item_shape)
    return ItemMap(page_size, page_size * item, total_slots * item, item, item // chunks, item // chunks, chunks)
