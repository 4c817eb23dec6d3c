"""``direct`` IO: byte-range copies, one per (page, layer), merged where memory is adjacent.

Works for layouts where the tokens of a page are contiguous within a layer (``layer_first``,
``page_first_direct``) on both sides. The ranges are computed in one vectorised pass from the
two ItemMaps and adjacent ranges are merged (a run of consecutive pages becomes one range).

A batch executes as a handful of native calls, never one per range. This matters because the
copies run on transfer lane threads beside the scheduler thread: every torch call releases
the GIL, and taking it back while the scheduler runs Python can cost up to a switch interval
(5 ms). A job made of hundreds of calls took seconds under a busy scheduler (issue 9; see
docs/hicache_design.md and scripts/bench/bench_lane_gil.py). So the index arithmetic is numpy
on small arrays (which keeps the GIL: no hand-off), and the bytes move in:

- small ranges (< ``_ROW_COPY_MAX_BYTES``): ``copy_rows``, one gather and one scatter;
- large ranges: ``copy_segments``, which cuts the ranges into equal rows and copies in one
  pass per run when either side's rows form at most ``_MAX_RUN_CALLS`` runs of consecutive
  rows, else gathers into staging rows and scatters, ``_STAGE_BYTES`` at a time. Gathers are ``torch.index_select`` into a slice and scatters numpy
  row assignments: both copy whole rows with memcpy and release the GIL once.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from sglang.srt.mem_cache.kvcacheio.spec import ComponentIO
from sglang.srt.mem_cache.pool_host.layout import ItemMap

try:  # optional C helper (python/setup.py): every range of a job in one call, GIL released
    from sglang.srt.mem_cache.kvcacheio import _native
except ImportError:  # no compiler at install time: the torch paths below serve
    _native = None

# Below this many bytes per (page, layer), one call per range costs more than copying the bytes
# twice (gather + scatter); measured on a 2-core CPU, see docs/host_pools.md.
_ROW_COPY_MAX_BYTES = 2 << 10
# Staging rows of a gather + scatter: small enough that the scatter reads them from cache.
_STAGE_BYTES = 1 << 20
# At most this many one-pass copies (one per run of consecutive rows) before gather + scatter.
_MAX_RUN_CALLS = 16
_local = threading.local()
# CPU <-> CPU copies: the native range copy when built (``NATIVE_COPY``), else strided page rows
# (``_copy_cpu_pages``); CPU_PAGE_ROWS False routes them through the row / segment paths the
# device copies take (tests exercise those paths on CPU this way).
NATIVE_COPY = _native is not None
CPU_PAGE_ROWS = True
_PAGE_STAGE_BYTES = 64 << 20  # staging bound of the page-row path (a job larger than this goes in pieces)
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def contiguous_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split paired index lists into (src_start, dst_start, length) runs where both are consecutive."""
    n = src.numel()
    if n == 0:
        return []
    s, d = _np(src), _np(dst)
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1])
    ends = np.append(starts[1:], n)
    return list(zip(s[starts].tolist(), d[starts].tolist(), (ends - starts).tolist()))


def _np(t) -> np.ndarray:
    """An int64 numpy view (or copy) of a CPU index tensor, array or list."""
    if isinstance(t, torch.Tensor):
        t = t.numpy()
    return np.asarray(t, dtype=np.int64)


def _page_offsets(
    src_map: ItemMap, dst_map: ItemMap, src_slots: torch.Tensor, dst_slots: torch.Tensor, layers: range, elem_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Byte offsets (int64 CPU tensors) of every (layer, page) on both sides, in (layer, page)
    order, and the bytes of one (page, layer). Slots are whole pages; both maps must keep a
    page's tokens contiguous within a layer."""
    P = src_map.page_size
    src_pages, dst_pages = _np(src_slots)[::P] // P, _np(dst_slots)[::P] // P
    lay = np.arange(layers.start, layers.stop, layers.step, dtype=np.int64)[:, None]
    src_off = ((src_pages * src_map.page_stride)[None, :] + lay * src_map.layer_stride).reshape(-1) * elem_bytes
    dst_off = ((dst_pages * dst_map.page_stride)[None, :] + lay * dst_map.layer_stride).reshape(-1) * elem_bytes
    return torch.from_numpy(src_off), torch.from_numpy(dst_off), P * src_map.chunk_numel * elem_bytes


def _merge(src_off, dst_off, seg: int) -> tuple[list[int], list[int], list[int]]:
    """Join ranges of ``seg`` bytes that continue each other on both sides."""
    s, d = _np(src_off), _np(dst_off)
    if s.size == 0:
        return [], [], []
    joined = (s[1:] == s[:-1] + seg) & (d[1:] == d[:-1] + seg)
    starts = np.concatenate([[0], np.flatnonzero(~joined) + 1])
    counts = np.diff(starts, append=s.size)
    return s[starts].tolist(), d[starts].tolist(), (counts * seg).tolist()


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
    # Device to host: the CPU scatter reads ``rows`` at once, so that copy must have landed
    # (non_blocking would hand back a pinned buffer the device has not written yet).
    to_host = src.device.type != "cpu" and dst.device.type == "cpu"
    _rows(dst, seg).index_copy_(0, (dst_off // seg).to(dst.device), rows.to(dst.device, non_blocking=not to_host))


def _page_view(t: torch.Tensor, m: ItemMap, seg: int, layers: range, views: dict | None) -> torch.Tensor:
    """``t`` as (layer in ``layers``, page, ``seg`` elements): row [i, p] is the range
    ``_page_offsets`` names for (layer layers[i], page p). Kept in ``views`` (the component's
    cache, see ComponentIO.views), so a lane job makes no view call: each torch call is a GIL
    hand-off."""
    key = (t.data_ptr(), m, seg, layers.start, layers.stop)
    view = views.get(key) if views is not None else None
    if view is None:  # in the widest integer word dividing every stride (row copies are memcpy)
        e = t.element_size()
        w = next(w for w in (8, 4, 2, 1) if (seg * e) % w == 0 and (m.layer_stride * e) % w == 0
                 and (m.page_stride * e) % w == 0 and t.data_ptr() % w == 0 and (t.numel() * e) % w == 0)
        flat = t.view(-1).view(torch.uint8).view(_WORDS[w])
        ls, ps, sg = m.layer_stride * e // w, m.page_stride * e // w, seg * e // w
        pages = (flat.numel() - (layers.stop - 1) * ls - sg) // ps + 1
        view = flat.as_strided((len(layers), pages, sg), (ls, ps, 1), flat.storage_offset() + layers.start * ls)
        if views is not None:
            views[key] = view
    return view


def _copy_cpu_pages(src, dst, src_map, dst_map, src_slots, dst_slots, layers: range, views) -> None:
    """CPU <-> CPU: every (layer, page) row of the job in one gather and one scatter, native
    calls that release the GIL once each, with no per-range Python (issue 9: the lanes must
    not hold the scheduler thread's GIL)."""
    P = src_map.page_size
    seg = P * src_map.chunk_numel
    sv, dv = _page_view(src, src_map, seg, layers, views), _page_view(dst, dst_map, seg, layers, views)
    sp = torch.from_numpy(_np(src_slots)[::P] // P)
    dp = torch.from_numpy(_np(dst_slots)[::P] // P)
    n = sp.numel()
    step = max(1, min(n, _PAGE_STAGE_BYTES // max(1, sv.shape[0] * sv.shape[2] * sv.element_size())))
    for lo in range(0, n, step):  # one piece unless the job exceeds the staging bound
        stage = _stage_like(sv, min(step, n - lo))
        torch.index_select(sv, 1, sp[lo : lo + step], out=stage)
        dv.index_copy_(1, dp[lo : lo + step], stage)


def _stage_like(view: torch.Tensor, pages: int) -> torch.Tensor:
    """This thread's staging buffer shaped (layers, ``pages``, row), reused across jobs."""
    shape = (view.shape[0], pages, view.shape[2])
    need = shape[0] * shape[1] * shape[2] * view.element_size()
    buf = getattr(_local, "pages", None)
    if buf is None or buf.numel() < need:
        buf = _local.pages = torch.empty(need, dtype=torch.uint8)
    return buf[:need].view(view.dtype).view(shape)


def copy_pages(src, dst, src_map, dst_map, src_slots, dst_slots, layers: range, views: dict | None = None) -> None:
    """Copy every (layer, page) of the paired slots: CPU <-> CPU as page rows (strided views
    cached in ``views``); otherwise small ranges by rows, large ones by segment."""
    on_cpu = src.device.type == "cpu" and dst.device.type == "cpu" and src.dtype == dst.dtype
    if CPU_PAGE_ROWS and on_cpu and not NATIVE_COPY and layers.step == 1 and len(layers):
        _copy_cpu_pages(src, dst, src_map, dst_map, src_slots, dst_slots, layers, views)
        return
    src_off, dst_off, seg = _page_offsets(src_map, dst_map, src_slots, dst_slots, layers, src.element_size())
    if src_off.numel() == 0:
        return
    if CPU_PAGE_ROWS and on_cpu and NATIVE_COPY:
        native_copy(src, dst, src_off.numpy(), dst_off.numpy(), seg)
        return
    if seg < _ROW_COPY_MAX_BYTES:
        copy_rows(src, dst, src_off, dst_off, seg)
    else:
        copy_segments(src, dst, *_merge(src_off, dst_off, seg))


def native_copy(src: torch.Tensor, dst: torch.Tensor, src_off: np.ndarray, dst_off: np.ndarray, lengths) -> None:
    """memcpy each byte range ``src_off[i] -> dst_off[i]`` (``lengths``: one int or per range)
    between two CPU tensors in one native call without the GIL; ValueError, with nothing copied,
    if a range leaves either buffer."""
    if not isinstance(lengths, int):
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    _native.copy_ranges(src.data_ptr(), src.numel() * src.element_size(), dst.data_ptr(),
                        dst.numel() * dst.element_size(), np.ascontiguousarray(src_off, dtype=np.int64),
                        np.ascontiguousarray(dst_off, dtype=np.int64), lengths)


def _check_bounds(offsets: np.ndarray, lengths: np.ndarray, t: torch.Tensor, what: str) -> None:
    lo, end = int(offsets.min()), int((offsets + lengths).max())
    if lo < 0 or end > t.numel() * t.element_size():
        raise RuntimeError(f"internal error: {what} copy range [{lo}, {end}) exceeds the buffer")


def _row_indices(offsets: np.ndarray, lengths: np.ndarray, unit: int) -> np.ndarray:
    """Indices of the ``unit``-byte rows covered by the byte ranges, range by range."""
    counts = lengths // unit
    shift = offsets // unit - (np.cumsum(counts) - counts)  # row index minus its position in the output
    return np.repeat(shift, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _runs(idx: np.ndarray) -> np.ndarray:
    """Start positions of the runs of consecutive integers in ``idx``, plus ``idx.size`` at the end."""
    return np.concatenate([[0], np.flatnonzero(np.diff(idx) != 1) + 1, [idx.size]])


def _stage(rows: torch.Tensor, max_rows: int) -> torch.Tensor:
    """This thread's staging rows (reused: a fresh buffer per call would page-fault every time)."""
    width = rows.shape[1]
    need = max_rows * width * rows.element_size()
    buf = getattr(_local, "stage", None)
    if buf is None or buf.numel() < need:
        buf = _local.stage = torch.empty(need, dtype=torch.uint8)
    return buf[:need].view(rows.dtype).view(max_rows, width)


def _copy_cpu_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor, s_idx: np.ndarray, d_idx: np.ndarray) -> None:
    """``dst_rows[d_idx] = src_rows[s_idx]`` (distinct destination rows) for 2-D CPU integer
    row views. When one side is a few runs of consecutive rows (a fresh host allocation is: one
    run per layer, or one in all for page_first_direct), one pass per run; otherwise a gather
    into staging rows and a scatter, ``_STAGE_BYTES`` at a time."""
    n = s_idx.size
    # Rows are disjoint, so any order will do: sorted by one side, that side is fewest runs
    # (page_first_direct keeps a page's layers together, so (layer, page) order would not be).
    by_dst = np.argsort(d_idx, kind="stable")
    s_idx, d_idx = s_idx[by_dst], d_idx[by_dst]
    d_runs = _runs(d_idx)
    if d_runs.size - 1 <= _MAX_RUN_CALLS:
        s_t = torch.from_numpy(s_idx)
        for lo, hi in zip(d_runs[:-1].tolist(), d_runs[1:].tolist()):
            d0 = int(d_idx[lo])
            torch.index_select(src_rows, 0, s_t[lo:hi], out=dst_rows[d0 : d0 + hi - lo])
        return
    by_src = np.argsort(s_idx, kind="stable")
    s_runs = _runs(s_idx[by_src])
    if s_runs.size - 1 <= _MAX_RUN_CALLS:
        s_sorted, d_sorted = s_idx[by_src], d_idx[by_src]
        src_np, dst_np = src_rows.numpy(), dst_rows.numpy()
        for lo, hi in zip(s_runs[:-1].tolist(), s_runs[1:].tolist()):
            s0 = int(s_sorted[lo])
            dst_np[d_sorted[lo:hi]] = src_np[s0 : s0 + hi - lo]
        return
    step = max(1, min(n, _STAGE_BYTES // (src_rows.shape[1] * src_rows.element_size())))
    stage, dst_np, s_t = _stage(src_rows, step), dst_rows.numpy(), torch.from_numpy(s_idx)
    for lo in range(0, n, step):
        k = min(step, n - lo)
        torch.index_select(src_rows, 0, s_t[lo : lo + k], out=stage[:k])
        dst_np[d_idx[lo : lo + k]] = stage[:k].numpy()


def copy_segments(src: torch.Tensor, dst: torch.Tensor, src_off, dst_off, lengths) -> None:
    """Copy byte ranges (``src_off[i]`` -> ``dst_off[i]``, ``lengths[i]`` bytes) between two
    contiguous tensors (any devices). The ranges are cut into rows of the largest size dividing
    every offset, length and both buffer sizes, and copied with a few native calls."""
    if not len(lengths):
        return
    s_off, d_off, lens = _np(src_off), _np(dst_off), _np(lengths)
    _check_bounds(s_off, lens, src, "source")
    _check_bounds(d_off, lens, dst, "destination")
    nbytes = np.array([src.numel() * src.element_size(), dst.numel() * dst.element_size()], dtype=np.int64)
    unit = int(np.gcd.reduce(np.concatenate([s_off, d_off, lens, nbytes])))  # rows tile both whole buffers
    s_idx, d_idx = _row_indices(s_off, lens, unit), _row_indices(d_off, lens, unit)
    if src.is_cuda or dst.is_cuda:
        copy_rows(src, dst, torch.from_numpy(s_idx * unit), torch.from_numpy(d_idx * unit), unit)
        return
    _copy_cpu_rows(_rows(src, unit), _rows(dst, unit), s_idx, d_idx)


def load_per_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int) -> None:
    copy_pages(c.host, c.device, c.host_map, c.device_map, host_idx, dev_idx, range(layer, layer + 1), c.views)


def backup_all_layer(c: ComponentIO, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    copy_pages(c.device, c.host, c.device_map, c.host_map, dev_idx, host_idx, range(c.layer_num), c.views)
