"""``kernel`` IO: the Triton copy kernel, or a torch stand-in where Triton cannot run."""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _triton_copy():
    from sglang.srt.mem_cache.kvcacheio import triton_kernels

    return triton_kernels.copy_items


@functools.lru_cache(maxsize=None)
def _triton_table_copy():
    from sglang.srt.mem_cache.kvcacheio import triton_kernels

    return triton_kernels.copy_items_from_table


@functools.lru_cache(maxsize=None)
def _gather():
    logger.warning(
        "io_backend=kernel without a GPU and without TRITON_INTERPRET=1: copying with the torch "
        "gather routine instead of the Triton kernel"
    )
    from sglang.srt.mem_cache.kvcacheio import gather

    return gather


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under its interpreter."""
    if device.type == "cuda":
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Triton's interpreter keeps per-launch state in module globals: two threads (the write and
# load lanes) launching at once corrupt each other. Compiled CUDA launches need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _interpreted_copy(*args) -> None:
    with _INTERPRETER_LOCK:
        _triton_copy()(*args)


def _interpreted_table_copy(*args) -> None:
    with _INTERPRETER_LOCK:
        _triton_table_copy()(*args)


def copy_fn(device: torch.device):
    """``copy_items`` (see ``triton_kernels``) for tensors on ``device``."""
    if not triton_usable(device):
        return _gather().copy_items
    return _triton_copy() if device.type == "cuda" else _interpreted_copy


def table_copy_fn(device: torch.device):
    """``copy_items_from_table`` for a pointer table on ``device``."""
    if not triton_usable(device):
        return _gather().copy_items_from_table
    return _triton_table_copy() if device.type == "cuda" else _interpreted_table_copy


def load_per_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int) -> None:
    copy_fn(c.device.device)(c.host, c.device, c.host_map, c.device_map, host_idx, dev_idx, layer, 1)


def backup_all_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    copy_fn(c.device.device)(c.device, c.host, c.device_map, c.host_map, dev_idx, host_idx, 0, c.layer_num)
