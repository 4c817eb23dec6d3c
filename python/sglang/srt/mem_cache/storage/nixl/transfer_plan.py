"""Descriptors of one NIXL transfer: which host bytes go to which offsets of which objects.

An object is ``payload || trailer``. Zero-copy objects move their payload straight from the
host pool's views (one descriptor per view, at increasing file offsets) and the trailer from a
staging slot; bounce objects move as one descriptor from a staging slot holding both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang.srt.mem_cache.storage.integrity import payload_checksum, poison_trailer, read_trailer
from sglang.srt.mem_cache.storage.nixl.pool_context import NixlPoolContext
from sglang.srt.mem_cache.storage.nixl.nixl_utils import Target
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO


@dataclass(slots=True)
class Item:
    """One object of one page in a transfer."""

    obj: ObjectIO
    zero_copy: bool
    target: Target
    slot: np.ndarray  # staging slot (uint8 view)
    slot_ptr: int
    trailer_bytes: int
    trailer: np.ndarray = field(init=False)  # where the object's trailer sits in the slot

    def __post_init__(self):
        start = 0 if self.zero_copy else self.obj.nbytes
        self.trailer = self.slot[start : start + self.trailer_bytes]

    @property
    def stored_bytes(self) -> int:
        return self.obj.nbytes + self.trailer_bytes

    def payload(self) -> list[np.ndarray]:
        return self.obj.views if self.zero_copy else [self.slot[: self.obj.nbytes]]

    def descriptors(self, dram: list, storage: list) -> None:
        """Append this object's (ptr, len) host and (offset, len, dev_id) storage descriptors."""
        dev, n, t = self.target.dev_id, self.obj.nbytes, self.trailer_bytes
        if not self.zero_copy:
            dram.append((self.slot_ptr, n + t))
            storage.append((0, n + t, dev))
            return
        offset = 0
        for view, ptr in zip(self.obj.views, self.obj.ptrs):
            dram.append((ptr, view.nbytes))
            storage.append((offset, view.nbytes, dev))
            offset += view.nbytes
        dram.append((self.slot_ptr, t))
        storage.append((n, t, dev))

    def stage_payload(self) -> int:
        """For bounce buffers, copy the payload into the slot; return its checksum."""
        if not self.zero_copy:
            offset = 0
            for view in self.obj.views:
                np.copyto(self.slot[offset : offset + view.nbytes], view)
                offset += view.nbytes
        return payload_checksum(self.payload())

    def read_result(self) -> tuple[int, int] | None:
        """(checksum, page digest) when the object read verifies, else None."""
        return read_trailer(self.trailer, self.obj.name, self.payload(), self.obj.nbytes)

    def prepare_read(self) -> None:
        poison_trailer(self.trailer)

    def unbounce(self) -> None:
        """Copy a verified bounce payload into the host pool's page, byte for byte."""
        if self.zero_copy:
            return
        offset = 0
        for view in self.obj.views:
            np.copyto(view, self.slot[offset : offset + view.nbytes])
            offset += view.nbytes


Planned = tuple[PageIO, list[Item]]


def descriptors(planned: list[Planned]) -> tuple[list, list, list]:
    """(dram, storage, storage registrations) of every object of every planned page."""
    dram, storage, regs = [], [], []
    for _, items in planned:
        for item in items:
            item.descriptors(dram, storage)
            regs.append(item.target.reg)
    return dram, storage, regs


class SlotCounter:
    """Hands out consecutive staging slots per pool within one chunk (``alt``: reads use the
    context's second get area)."""

    def __init__(self, alt: bool = False):
        self._next: dict = {}
        self._alt = alt

    def item(self, obj: ObjectIO, ctx: NixlPoolContext, target: Target, write: bool, trailer_bytes: int) -> Item:
        """The Item of ``obj`` moving through ``target``, on the next free slot of ``ctx``."""
        i = self._next.get(ctx.codec.name, 0)
        self._next[ctx.codec.name] = i + 1
        area = ctx.set_area if write else (ctx.get_area_alt if self._alt else ctx.get_area)
        slot, ptr = area.slot(i)
        return Item(obj, ctx.is_zero_copy, target, slot, ptr, trailer_bytes)
