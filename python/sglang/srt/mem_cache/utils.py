"""Index validation shared by allocators, device pools and host pools."""

from __future__ import annotations

import numpy as np
import torch


def as_cpu_index(indices, what: str) -> torch.Tensor:
    """Return ``indices`` as a 1-D int64 CPU tensor; raise TypeError/ValueError when it cannot be."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what} must be an int32/int64 tensor, got dtype {indices.dtype}")
        if indices.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
        return indices.to(device="cpu", dtype=torch.int64)
    try:
        return torch.as_tensor(list(indices), dtype=torch.int64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be a sequence of ints: {exc}") from None


def check_in_range(indices: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Raise ValueError unless every index is in [lo, hi)."""
    if indices.numel() == 0:
        return
    arr = indices.numpy()  # numpy: no OpenMP hand-off for a few thousand ints
    mn, mx = int(arr.min()), int(arr.max())
    if mn < lo or mx >= hi:
        raise ValueError(f"{what} out of range: min {mn}, max {mx}, allowed [{lo}, {hi})")


def check_page_aligned(indices: torch.Tensor, page_size: int, what: str) -> None:
    """Raise ValueError unless ``indices`` (a CPU tensor) is a list of whole pages.

    A whole page is ``page_size`` consecutive token slots starting at a multiple of ``page_size``;
    pages may come in any order.
    """
    if page_size == 1:
        return
    n = indices.numel()
    if n % page_size:
        raise ValueError(f"{what}: length {n} is not a multiple of page_size {page_size}")
    if n == 0:
        return
    rows = indices.numpy().reshape(-1, page_size)
    starts = rows[:, 0]
    misaligned = starts % page_size != 0
    if misaligned.any():
        bad = int(starts[misaligned][0])
        raise ValueError(f"{what}: page starts at slot {bad}, not a multiple of page_size {page_size}")
    if not (rows == starts[:, None] + np.arange(page_size)).all():
        raise ValueError(f"{what}: a page is not {page_size} consecutive slots")


def page_starts(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """First token slot of every page in a page-aligned index list."""
    return indices[::page_size]


def get_hash_str(token_ids, prior_hash: str | None = None, page_size: int | None = None) -> str | list[str]:
    """Upstream's page-hash entry point over this fork's chain (``radix/page_hash.py``).

    With ``page_size``: the hashes of every whole page of ``token_ids`` (a list; a trailing
    partial page is ignored), chained from ``prior_hash`` (hex), or from the default namespace's
    seed when None. Without: the hash of ``token_ids`` as one page (a string)."""
    from sglang.srt.mem_cache.radix.page_hash import hash_page, namespace_hash, page_hashes

    prior = prior_hash if prior_hash else namespace_hash()
    if page_size is None:
        return hash_page(prior, token_ids)
    return page_hashes(token_ids, page_size, prior)
