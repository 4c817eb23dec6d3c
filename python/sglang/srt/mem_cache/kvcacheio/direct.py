"""``direct`` IO: byte-range copies, one per (page, layer), merged where memory is adjacent.

Works for layouts where the tokens of a page are contiguous within a layer (``layer_first``,
``page_first_direct``) on both sides. The ranges are computed in one vectorised pass from the
two ItemMaps, adjacent ranges are merged (a run of consecutive pages becomes one copy), and
then executed:

- on CUDA as ``copy_`` of byte slices (each an async memcpy on the current stream);
- on CPU as ``memcpy`` calls spread over a few threads, because one memcpy uses one core and a
  Python loop over tensor views costs more than copying a 64 KiB page.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO
from sglang.srt.mem_cache.pool_host.layout import ItemMap

_MIN_BYTES_PER_WORKER = 1 << 20
# Below this many bytes per (page, layer), one call per range costs more than copying the bytes
# twice (gather + scatter); measured on a 2-core CPU, see docs/host_pools.md.
_ROW_COPY_MAX_BYTES = 2 << 10
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def contiguous_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split paired index lists into (src_start, dst_start, length) runs where both are consecutive."""
    n = src.numel()
    if n == 0:
        return []
    breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()))


def _page_offsets(
    src_map: ItemMap, dst_map: ItemMap, src_slots: torch.Tensor, dst_slots: torch.Tensor, layers: range, elem_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Byte offsets of every (layer, page) on both sides, in (layer, page) order, and the
    bytes of one (page, layer). Slots are whole pages; both maps must keep a page's tokens
    contiguous within a layer."""
    P = src_map.page_size
    src_pages, dst_pages = src_slots[::P] // P, dst_slots[::P] // P
    lay = torch.tensor(list(layers), dtype=torch.int64)[:, None]
    src_off = ((src_pages * src_map.page_stride)[None, :] + lay * src_map.layer_stride).reshape(-1) * elem_bytes
    dst_off = ((dst_pages * dst_map.page_stride)[None, :] + lay * dst_map.layer_stride).reshape(-1) * elem_bytes
    return src_off, dst_off, P * src_map.chunk_numel * elem_bytes


def _merge(src_off: torch.Tensor, dst_off: torch.Tensor, seg: int) -> tuple[list[int], list[int], list[int]]:
    if src_off.numel() == 0:
        return [], [], []
    joined = (src_off[1:] == src_off[:-1] + seg) & (dst_off[1:] == dst_off[:-1] + seg)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), (~joined).nonzero().flatten() + 1])
    counts = torch.diff(starts, append=torch.tensor([src_off.numel()]))
    return src_off[starts].tolist(), dst_off[starts].tolist(), (counts * seg).tolist()


def page_segments(
    src_map: ItemMap, dst_map: ItemMap, src_slots: torch.Tensor, dst_slots: torch.Tensor, layers: range, elem_bytes: int
) -> tuple[list[int], list[int], list[int]]:
    """Byte (src_offset, dst_offset, length) of every (layer, page), adjacent ranges merged."""
    return _merge(*_page_offsets(src_map, dst_map, src_slots, dst_slots, layers, elem_bytes))


def _rows(t: torch.Tensor, seg: int) -> torch.Tensor:
    """``t``'s bytes as rows of ``seg`` bytes, in the widest integer word that divides ``seg``."""
    flat = t.view(-1).view(torch.uint8)
    for word, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if seg % word == 0 and t.data_ptr() % word == 0:
            return flat.view(dtype).view(-1, seg // word)
    return flat.view(-1, seg)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor, seg: int) -> None:
    """Copy ``seg``-byte ranges (offsets multiples of ``seg``) as one gather and one scatter:
    two passes over the bytes, but no per-range call, which wins for small ranges."""
    rows = _rows(src, seg).index_select(0, (src_off // seg).to(src.device))
    _rows(dst, seg).index_copy_(0, (dst_off // seg).to(dst.device), rows.to(dst.device, non_blocking=True))


def copy_pages(src, dst, src_map, dst_map, src_slots, dst_slots, layers: range) -> None:
    """Copy every (layer, page) of the paired slots: small ranges by rows, large ones by segment."""
    src_off, dst_off, seg = _page_offsets(src_map, dst_map, src_slots, dst_slots, layers, src.element_size())
    if src_off.numel() == 0:
        return
    if seg < _ROW_COPY_MAX_BYTES:
        copy_rows(src, dst, src_off, dst_off, seg)
    else:
        copy_segments(src, dst, *_merge(src_off, dst_off, seg))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="kv-direct-copy")
        return _pool


def _memcpy_all(dst_ptrs: list[int], src_ptrs: list[int], lengths: list[int]) -> None:
    move = ctypes.memmove  # a foreign call: drops the GIL while copying
    for d, s, n in zip(dst_ptrs, src_ptrs, lengths):
        move(d, s, n)


def _check_bounds(offsets: list[int], lengths: list[int], t: torch.Tensor, what: str) -> None:
    end = max(o + n for o, n in zip(offsets, lengths))
    if min(offsets) < 0 or end > t.numel() * t.element_size():
        raise RuntimeError(f"internal error: {what} copy range [{min(offsets)}, {end}) exceeds the buffer")


def copy_segments(src: torch.Tensor, dst: torch.Tensor, src_off: list[int], dst_off: list[int], lengths: list[int]) -> None:
    """Copy byte ranges between two contiguous tensors (any devices)."""
    if not lengths:
        return
    _check_bounds(src_off, lengths, src, "source")
    _check_bounds(dst_off, lengths, dst, "destination")
    if src.is_cuda or dst.is_cuda:
        s, d = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        for so, do, n in zip(src_off, dst_off, lengths):
            d[do : do + n].copy_(s[so : so + n], non_blocking=True)
        return
    sb, db = src.data_ptr(), dst.data_ptr()
    src_ptrs, dst_ptrs = [sb + o for o in src_off], [db + o for o in dst_off]
    workers = max(1, min(torch.get_num_threads(), len(lengths), sum(lengths) // _MIN_BYTES_PER_WORKER))
    if workers == 1:
        _memcpy_all(dst_ptrs, src_ptrs, lengths)
        return
    bounds = [len(lengths) * w // workers for w in range(workers + 1)]  # contiguous shares
    futures = [
        _executor(torch.get_num_threads()).submit(
            _memcpy_all, dst_ptrs[lo:hi], src_ptrs[lo:hi], lengths[lo:hi]
        )
        for lo, hi in zip(bounds, bounds[1:])
    ]
    for fut in futures:
        fut.result()


def load_per_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int) -> None:
    copy_pages(c.host, c.device, c.host_map, c.device_map, host_idx, dev_idx, range(layer, layer + 1))


def backup_all_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    copy_pages(c.device, c.host, c.device_map, c.host_map, dev_idx, host_idx, range(c.layer_num))
