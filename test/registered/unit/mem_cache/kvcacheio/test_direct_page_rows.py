"""Direct IO, CPU <-> CPU: the native range copy (``csrc/native_copy.c``) and the torch
page-row path (``direct._copy_cpu_pages``) move the same bytes as the row / segment paths, in a
number of calls that does not grow with the pages moved; the native copy checks every range
before it copies any.

The lanes run these copies beside the scheduler thread; every torch call is a GIL hand-off
(issue 9), so a job must be a few native calls whatever its size.
"""

import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.mem_cache.kvcacheio import direct
from sglang.srt.mem_cache.kvcacheio.dispatch import DIRECT
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_host_pool
from sglang.test.real_pools import BF16, DST_PAGES, HOST_PAGES, SRC_PAGES, as_u8, randomized_real_pools, slots, table_cells

register_cpu_ci(est_time=6, suite="per-commit-cpu")

DIRECT_CELLS, CELL_IDS = table_cells(IOBackend.DIRECT, DIRECT)


def pools(kind, layout, seed):
    return randomized_real_pools(kind, layout, seed=seed)[:3]


HAVE_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_native = pytest.mark.skipif(direct._native is None and not HAVE_COMPILER,
                                  reason="native copy helper not built: no C compiler on this machine")
CPU_PATHS = [pytest.param("native", marks=needs_native), "page_rows"]


def round_trip(kind, layout, page_rows, monkeypatch):
    """Backup, then load every layer (any order): every byte of host and destination pool.
    ``page_rows``: "native", "page_rows" (torch), or False (the row / segment paths)."""
    monkeypatch.setattr(direct, "CPU_PAGE_ROWS", bool(page_rows))
    monkeypatch.setattr(direct, "NATIVE_COPY", page_rows == "native")
    src, dst, host = pools(kind, layout, seed=3)
    P = host.page_size
    h_idx, s_idx, d_idx = slots(HOST_PAGES, P), slots(SRC_PAGES, P), slots(DST_PAGES, P)
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    for layer in reversed(range(host.layer_num)):
        host.load_to_device_per_layer(dst, h_idx, d_idx, layer)
    return ({c.name: as_u8(host.host_buffer(c.name)).clone() for c in host.components},
            {n: as_u8(b).clone() for n, b in dst.buffers.items()})


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_cpu_paths_move_the_same_bytes_as_the_range_paths(kind, layout, path, monkeypatch):
    rows_host, rows_dev = round_trip(kind, layout, path, monkeypatch)
    ref_host, ref_dev = round_trip(kind, layout, False, monkeypatch)
    assert rows_host.keys() == ref_host.keys() and rows_dev.keys() == ref_dev.keys()
    for name in ref_host:
        assert torch.equal(rows_host[name], ref_host[name]), f"host {name}"
    for name in ref_dev:
        assert torch.equal(rows_dev[name], ref_dev[name]), f"device {name}"


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value)
def test_torch_calls_per_job_do_not_grow_with_pages(layout, monkeypatch):
    """Scattered pages on both sides: 2 and 24 pages make the same torch calls, one gather
    and one scatter per component, for a backup and for a one-layer load (torch page rows)."""
    monkeypatch.setattr(direct, "NATIVE_COPY", False)
    src = MHATokenToKVPool(32 * 16, 16, BF16, 2, 64, 4)
    host = make_host_pool(src, layout, "direct")
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(64, generator=gen)
    dev = (torch.randperm(31, generator=gen) + 1).tolist()
    counts = {}
    for n in (2, 24):
        h_idx, d_idx = slots(perm[:n].tolist(), 16), slots(dev[:n], 16)
        for what, call in (("backup", lambda: host.backup_from_device_all_layer(src, h_idx, d_idx)),
                           ("load", lambda: host.load_to_device_per_layer(src, h_idx, d_idx, 1))):
            call()  # builds and caches the views and the staging buffer
            with OpCounter() as counter:
                call()
            counts[what, n] = counter.ops
            assert sum("index_select" in op for op in counter.ops) == len(host.components), counter.ops
            assert sum("index_copy" in op for op in counter.ops) == len(host.components), counter.ops
    assert counts["backup", 2] == counts["backup", 24]
    assert counts["load", 2] == counts["load", 24]


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS[:2], ids=CELL_IDS[:2])
def test_page_rows_staged_in_pieces_move_the_same_bytes(kind, layout, monkeypatch):
    """A staging bound below one page: every page is its own gather + scatter."""
    monkeypatch.setattr(direct, "_PAGE_STAGE_BYTES", 1)
    rows_host, rows_dev = round_trip(kind, layout, "page_rows", monkeypatch)
    ref_host, ref_dev = round_trip(kind, layout, False, monkeypatch)
    for name in ref_host:
        assert torch.equal(rows_host[name], ref_host[name]), f"host {name}"
    for name in ref_dev:
        assert torch.equal(rows_dev[name], ref_dev[name]), f"device {name}"


def test_native_helper_is_built_where_a_compiler_exists():
    """The install builds it (python/setup.py); an optional build that failed must not pass
    unnoticed on a machine that could build it."""
    if HAVE_COMPILER:
        assert direct._native is not None and direct.NATIVE_COPY, "reinstall: pip install -e python"


@needs_native
def test_native_job_is_one_call_without_torch_ops(monkeypatch):
    """The whole job (all layers, both components) in native calls: no torch op at all, and
    the number of native calls (one per component) does not grow with the pages."""
    monkeypatch.setattr(direct, "NATIVE_COPY", True)
    calls = []
    real = direct._native.copy_ranges
    monkeypatch.setattr(direct._native, "copy_ranges", lambda *a: calls.append(len(a[4])) or real(*a))
    src = MHATokenToKVPool(32 * 16, 16, BF16, 2, 64, 4)
    host = make_host_pool(src, HostLayout.LAYER_FIRST, "direct")
    for n in (2, 24):
        calls.clear()
        h_idx, d_idx = slots(list(range(2 * n - 1, -1, -2)), 16), slots(list(range(1, 1 + n)), 16)
        host.backup_from_device_all_layer(src, h_idx, d_idx)
        with OpCounter() as counter:
            host.backup_from_device_all_layer(src, h_idx, d_idx)
        assert [op for op in counter.ops if "index" in op or "copy" in op] == [], counter.ops
        assert calls == [n * 4] * 4, calls  # 2 components x (warm-up + counted) calls, n pages x 4 layers each


@needs_native
def test_native_copy_checks_every_range_before_copying():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    import numpy as np

    with pytest.raises(ValueError, match="range 1 .* is outside the buffers"):
        direct.native_copy(src, dst, np.array([0, 60]), np.array([0, 8]), 8)
    assert int(dst.sum()) == 0, "nothing is copied when one range is out of bounds"
    with pytest.raises(ValueError, match="same number of ranges"):
        direct.native_copy(src, dst, np.array([0, 8]), np.array([0]), 8)
    direct.native_copy(src, dst, np.array([0, 40]), np.array([16, 0]), np.array([8, 4]))
    assert dst[16:24].tolist() == list(range(8)) and dst[0:4].tolist() == [40, 41, 42, 43]
    big_src = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)  # a streamed (non-temporal) job
    big_dst = torch.zeros_like(big_src)
    offs = np.random.default_rng(0).permutation(32) * (128 << 10)
    direct.native_copy(big_src, big_dst, offs, np.arange(32) * (128 << 10) + 3, (128 << 10) - 3)
    for i, o in enumerate(offs.tolist()):
        lo = i * (128 << 10) + 3
        assert torch.equal(big_dst[lo : lo + (128 << 10) - 3], big_src[o : o + (128 << 10) - 3])
