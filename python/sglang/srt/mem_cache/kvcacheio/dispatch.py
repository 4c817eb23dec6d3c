"""The one table that says which routine serves (pool kind, host layout, io_backend).

Routines work per component, so the table only needs to know, per pool kind, which layouts
each backend supports. A cell missing from ``IO_TABLE`` is unsupported: host pools look their
cell up at construction and fail there, naming the supported cells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sglang.srt.mem_cache.kvcacheio import direct, kernel
from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend

LoadFn = Callable[[ComponentIO, torch.Tensor, torch.Tensor, int], None]
BackupFn = Callable[[ComponentIO, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class IORoutine:
    """``load_per_layer``: host -> device for one layer; ``backup_all_layer``: device -> host."""

    name: str
    load_per_layer: LoadFn
    backup_all_layer: BackupFn


def _noop_load(c, host_idx, dev_idx, layer):
    return None


def _noop_backup(c, host_idx, dev_idx):
    return None


KERNEL = IORoutine("kernel", kernel.load_per_layer, kernel.backup_all_layer)
DIRECT = IORoutine("direct", direct.load_per_layer, direct.backup_all_layer)
NOOP = IORoutine("noop", _noop_load, _noop_backup)

LF, PF, PFD, PH = (
    HostLayout.LAYER_FIRST,
    HostLayout.PAGE_FIRST,
    HostLayout.PAGE_FIRST_DIRECT,
    HostLayout.PAGE_HEAD,
)
K, D = IOBackend.KERNEL, IOBackend.DIRECT

_NO_PAGE_HEAD_KINDS = (
    PoolKind.MLA,
    PoolKind.ASYMMETRIC_MHA,
    PoolKind.MAMBA,
    PoolKind.DSA_INDEXER,
    PoolKind.DSV4_STATE,
)

# (kind, layout, io_backend) -> routine. page_first is kernel-only (direct would need one
# copy per token); page_head only makes sense for MHA heads (the asymmetric pool's K and V
# heads differ in size, so it stays page-major); the logical anchor has no bytes, so every
# cell is a no-op.
IO_TABLE: dict[tuple[PoolKind, HostLayout, IOBackend], IORoutine] = {
    **{(PoolKind.MHA, lay, K): KERNEL for lay in (LF, PF, PFD, PH)},
    **{(PoolKind.MHA, lay, D): DIRECT for lay in (LF, PFD)},
    **{(kind, lay, K): KERNEL for kind in _NO_PAGE_HEAD_KINDS for lay in (LF, PF, PFD)},
    **{(kind, lay, D): DIRECT for kind in _NO_PAGE_HEAD_KINDS for lay in (LF, PFD)},
    **{(PoolKind.DSV4_ANCHOR, lay, io): NOOP for lay in (LF, PF, PFD) for io in (K, D)},
}


def supported_cells(kind: PoolKind) -> list[tuple[str, str]]:
    return sorted((lay.value, io.value) for (k, lay, io) in IO_TABLE if k is kind)


def resolve_io(kind: PoolKind, layout: HostLayout, io_backend: IOBackend) -> IORoutine:
    """The routine for a cell; ValueError naming the supported (layout, io_backend) pairs."""
    try:
        return IO_TABLE[(kind, layout, io_backend)]
    except KeyError:
        cells = ", ".join(f"{lay}+{io}" for lay, io in supported_cells(kind))
        # the layouts this backend serves for this kind, page-contiguous ones first (upstream's)
        fits = sorted((lay for (k, lay, io) in IO_TABLE if k is kind and io is io_backend),
                      key=lambda lay: (not lay.page_contiguous, lay.value))
        expected = " or ".join(repr(lay.value) for lay in fits) or "another io_backend"
        raise ValueError(
            f"{kind.value} host pool does not support layout={layout.value} with io_backend={io_backend.value}: "
            f"expected {expected} (supported: {cells})"
        ) from None


def default_io_backend(device: torch.device | str) -> IOBackend:
    """``kernel`` on CUDA, ``direct`` elsewhere."""
    return IOBackend.KERNEL if torch.device(device).type == "cuda" else IOBackend.DIRECT
