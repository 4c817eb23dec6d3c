"""``direct`` IO: tensor copies coalesced over runs of consecutive slots (or pages).

A run is a stretch where both the host and the device indices advance by one, so a batch of
pages allocated together moves with one copy per run (per layer when loading one layer).
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO


def contiguous_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split paired index lists into (src_start, dst_start, length) runs where both are consecutive."""
    n = src.numel()
    if n == 0:
        return []
    breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()))


def load_layer_first(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int) -> None:
    for h, d, n in contiguous_runs(host_idx, dev_idx):
        c.device[layer, d : d + n].copy_(c.host[layer, h : h + n], non_blocking=True)


def backup_layer_first(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    for h, d, n in contiguous_runs(host_idx, dev_idx):
        c.host[:, h : h + n].copy_(c.device[:, d : d + n], non_blocking=True)


def _page_runs(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> list[tuple[int, int, int]]:
    P = c.page_size
    return contiguous_runs(host_idx[::P] // P, dev_idx[::P] // P)


def load_page_first_direct(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int) -> None:
    P, item = c.page_size, c.device.shape[2:]
    for hp, dp, n in _page_runs(c, host_idx, dev_idx):
        dst = c.device[layer, dp * P : (dp + n) * P].view(n, P, *item)
        dst.copy_(c.host[hp : hp + n, layer], non_blocking=True)


def backup_page_first_direct(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    P, L, item = c.page_size, c.layer_num, c.device.shape[2:]
    for hp, dp, n in _page_runs(c, host_idx, dev_idx):
        src = c.device[:, dp * P : (dp + n) * P].view(L, n, P, *item).transpose(0, 1)
        c.host[hp : hp + n].copy_(src, non_blocking=True)
