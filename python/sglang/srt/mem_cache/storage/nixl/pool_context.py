"""Per-pool NIXL state: zero-copy or bounce buffers, O_DIRECT or not, and staging slots.

* zero-copy (POSIX plugin, page-contiguous layouts: ``page_first``, ``page_first_direct``,
  ``page_head``, and upstream-style pools that expose their buffers): the pool's host buffers
  are registered once and each object's payload moves straight between them and the file; only
  the integrity trailer passes through a staging slot. An unaligned pool stays zero-copy, only
  without O_DIRECT (upstream falls back to bounce buffers).
* bounce (``layer_first``, whose pages are scattered over layers, staged upstream-style pools,
  and every pool with the OBJ plugin, whose objects must be written in one piece): each object
  is assembled as ``payload || trailer`` in a byte (uint8) slot sized from the flat page, never
  from the pool's dtype, and copied to or from the host pool byte for byte.

Each context has two staging areas, one for set and one for get, so the backup and prefetch
threads never share one (a zero-copy context has a second, small get area, for pipelined
reads). O_DIRECT is used for a pool when the extra config allows it, the filesystem supports
it, and every offset, length and address of its objects is 4096-aligned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

import torch

from sglang.srt.mem_cache.pool_host.memory import HostBuffer
from sglang.srt.mem_cache.storage.nixl.nixl_config import NixlOptions, StorageKind
from sglang.srt.mem_cache.storage.pool_codec import PoolCodec

logger = logging.getLogger(__name__)

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class StagingArea:
    """``num_slots`` byte slots of ``slot_bytes`` each in one page-aligned buffer. The slots'
    numpy views and addresses are cut once here, not per object moved."""

    def __init__(self, slot_bytes: int, num_slots: int):
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._buffer = HostBuffer(slot_bytes * num_slots, pin_memory=False)
        self.tensor = self._buffer.tensor
        array, base = self.tensor.numpy(), self.tensor.data_ptr()
        self._slots = [(array[i * slot_bytes : (i + 1) * slot_bytes], base + i * slot_bytes) for i in range(num_slots)]

    def rows(self, n: int) -> np.ndarray:
        """The first ``n`` slots as one (n, slot_bytes) uint8 array (the batch path's trailers)."""
        if not 0 <= n <= self.num_slots:
            raise IndexError(f"{n} staging slots asked, {self.num_slots} exist")
        return self.tensor.numpy().reshape(self.num_slots, self.slot_bytes)[:n]

    def slot(self, i: int) -> tuple[np.ndarray, int]:
        """(uint8 view, address) of slot ``i``."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"staging slot {i} outside [0, {self.num_slots})")
        return self._slots[i]


@dataclass
class NixlPoolContext:
    """One registered pool's transfer state (upstream's ``_HybridPoolContext`` names:
    ``is_zero_copy``, ``host_pool``, ``bounce_set``, ``bounce_get``, ``bounce_page_bytes``)."""

    codec: PoolCodec
    is_zero_copy: bool
    direct: bool
    set_area: StagingArea
    get_area: StagingArea
    # zero-copy only (trailer slots, a few KiB): second get and set areas, for the second lane
    # of a read or a write (HiCacheNixl._read_pages, _write_pages)
    get_area_alt: StagingArea | None = None
    set_area_alt: StagingArea | None = None

    @property
    def host_pool(self):
        return self.codec.host_pool

    @property
    def bounce_page_bytes(self) -> int:
        """Payload bytes of one key's page moved through a bounce slot (0: zero-copy)."""
        return 0 if self.is_zero_copy else self.codec.page_nbytes

    @property
    def bounce_set(self) -> torch.Tensor | None:
        """The write staging slots, one row each (None: zero-copy, only trailers are staged)."""
        return None if self.is_zero_copy else self.set_area.tensor.view(self.set_area.num_slots, -1)

    @property
    def bounce_get(self) -> torch.Tensor | None:
        """The read staging slots, one row each (None: zero-copy)."""
        return None if self.is_zero_copy else self.get_area.tensor.view(self.get_area.num_slots, -1)


def build_context(codec: PoolCodec, options: NixlOptions, use_direct_io: bool, trailer_bytes: int) -> NixlPoolContext:
    """``use_direct_io``: O_DIRECT asked for and allowed by the filesystem (NixlFileManager)."""
    pool = codec.host_pool
    zero_copy = options.spec.kind is StorageKind.FILE and (
        codec.is_marker or (codec.zero_copy and codec.shape.page_contiguous))
    aligned = all(s.nbytes % ALIGN == 0 for s in codec.segments) and (
        not zero_copy or codec.is_marker or _stride_aligned(pool)
    )
    direct = use_direct_io and aligned
    largest = max(s.nbytes for s in codec.segments)
    slot_bytes = trailer_bytes if zero_copy else round_up(largest + trailer_bytes)
    slots = options.bounce_pages * len(codec.segments)
    def area(needed: bool = True) -> StagingArea | None:
        return StagingArea(slot_bytes, slots) if needed else None

    ctx = NixlPoolContext(codec, zero_copy, direct, area(), area(), area(zero_copy), area(zero_copy))
    logger.info(
        "HiCacheNixl pool %s: %s, O_DIRECT %s, staging %d x %.1f MiB",
        codec.name.value,
        "zero-copy" if zero_copy else "bounce buffers",
        "on" if direct else "off",
        4 if zero_copy else 2,
        slot_bytes * slots / (1 << 20),
    )
    return ctx


def _stride_aligned(pool) -> bool:
    """Whether every page buffer of ``pool`` starts ALIGN-aligned (a pool that cannot say: no)."""
    check = getattr(pool, "is_stride_page_aligned", None)
    return bool(check(ALIGN)) if callable(check) else False
