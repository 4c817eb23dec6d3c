"""Descriptors of one NIXL transfer: which host bytes go to which offsets of which objects.

An object is ``payload || trailer``. Zero-copy objects move their payload straight from the
host pool's views (one descriptor per view, at increasing file offsets) and the trailer from a
staging slot; bounce objects move as one descriptor from a staging slot holding both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang.srt.mem_cache.storage.integrity import pack_trailer, payload_checksum, poison_trailer, read_trailer
from sglang.srt.mem_cache.storage.nixl.pool_context import NixlPoolContext
from sglang.srt.mem_cache.storage.nixl.storage_side import Target
from sglang.srt.mem_cache.storage.pool_codec import ObjectIO, PageIO


@dataclass
class Item:
    """One object of one page in a transfer."""

    obj: ObjectIO
    ctx: NixlPoolContext
    target: Target
    slot: torch.Tensor  # staging slot (uint8)
    trailer_bytes: int

    @property
    def stored_bytes(self) -> int:
        return self.obj.nbytes + self.trailer_bytes

    def payload(self) -> list[np.ndarray]:
        if self.ctx.zero_copy:
            return [v.numpy() for v in self.obj.views]
        return [self.slot[: self.obj.nbytes].numpy()]

    def trailer(self) -> np.ndarray:
        start = 0 if self.ctx.zero_copy else self.obj.nbytes
        return self.slot[start : start + self.trailer_bytes].numpy()

    def descriptors(self) -> tuple[list, list]:
        """(dram (ptr, len) list, storage (offset, len, dev_id) list) of this object."""
        dev, n, t = self.target.dev_id, self.obj.nbytes, self.trailer_bytes
        if not self.ctx.zero_copy:
            return [(self.slot.data_ptr(), n + t)], [(0, n + t, dev)]
        dram, storage, offset = [], [], 0
        for view in self.obj.views:
            dram.append((view.data_ptr(), view.numel()))
            storage.append((offset, view.numel(), dev))
            offset += view.numel()
        return dram + [(self.slot.data_ptr(), t)], storage + [(n, t, dev)]

    def stage_payload(self) -> int:
        """For bounce buffers, copy the payload into the slot; return its checksum."""
        if not self.ctx.zero_copy:
            offset = 0
            for view in self.obj.views:
                self.slot[offset : offset + view.numel()].copy_(view)
                offset += view.numel()
        return payload_checksum(self.payload())

    def stage_trailer(self, checksum: int, page_digest: int) -> None:
        trailer = pack_trailer(self.obj.name, self.obj.nbytes, checksum, page_digest, self.trailer_bytes)
        self.trailer()[:] = np.frombuffer(trailer, dtype=np.uint8)

    def read_result(self) -> tuple[int, int] | None:
        """(checksum, page digest) when the object read verifies, else None."""
        return read_trailer(self.trailer(), self.obj.name, self.payload())

    def prepare_read(self) -> None:
        poison_trailer(self.trailer())

    def unbounce(self) -> None:
        """Copy a verified bounce payload into the host pool's page, byte for byte."""
        if self.ctx.zero_copy:
            return
        offset = 0
        for view in self.obj.views:
            view.copy_(self.slot[offset : offset + view.numel()])
            offset += view.numel()


Planned = tuple[PageIO, list[Item]]


def descriptors(planned: list[Planned]) -> tuple[list, list, list]:
    """(dram, storage, storage registrations) of every object of every planned page."""
    dram, storage, regs = [], [], []
    for _, items in planned:
        for item in items:
            d, s = item.descriptors()
            dram += d
            storage += s
            regs.append(item.target.reg)
    return dram, storage, regs


class SlotCounter:
    """Hands out consecutive staging slots per pool within one chunk."""

    def __init__(self):
        self._next: dict = {}

    def take(self, ctx: NixlPoolContext, write: bool) -> torch.Tensor:
        i = self._next.get(ctx.codec.name, 0)
        self._next[ctx.codec.name] = i + 1
        return (ctx.set_area if write else ctx.get_area).slot(i)
