"""Direct IO, CPU <-> CPU page-row path (``direct._copy_cpu_pages``): same bytes as the
row / segment paths, in a number of torch calls that does not grow with the pages moved.

The lanes run these copies beside the scheduler thread; every torch call is a GIL hand-off
(issue 9), so a job must be a few native calls whatever its size.
"""

import os

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


def round_trip(kind, layout, page_rows: bool, monkeypatch):
    """Backup, then load every layer (any order): every byte of host and destination pool."""
    monkeypatch.setattr(direct, "CPU_PAGE_ROWS", page_rows)
    src, dst, host = pools(kind, layout, seed=3)
    P = host.page_size
    h_idx, s_idx, d_idx = slots(HOST_PAGES, P), slots(SRC_PAGES, P), slots(DST_PAGES, P)
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    for layer in reversed(range(host.layer_num)):
        host.load_to_device_per_layer(dst, h_idx, d_idx, layer)
    return ({c.name: as_u8(host.host_buffer(c.name)).clone() for c in host.components},
            {n: as_u8(b).clone() for n, b in dst.buffers.items()})


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_page_rows_move_the_same_bytes_as_the_range_paths(kind, layout, monkeypatch):
    rows_host, rows_dev = round_trip(kind, layout, True, monkeypatch)
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
def test_torch_calls_per_job_do_not_grow_with_pages(layout):
    """Scattered pages on both sides: 2 and 24 pages make the same torch calls, one gather
    and one scatter per component, for a backup and for a one-layer load."""
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
    rows_host, rows_dev = round_trip(kind, layout, True, monkeypatch)
    ref_host, ref_dev = round_trip(kind, layout, False, monkeypatch)
    for name in ref_host:
        assert torch.equal(rows_host[name], ref_host[name]), f"host {name}"
    for name in ref_dev:
        assert torch.equal(rows_dev[name], ref_dev[name]), f"device {name}"
