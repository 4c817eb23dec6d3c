"""Device -> host -> fresh device round trips for every supported cell of the IO table.

Random non-contiguous, unsorted page sets; page sizes 1..64; every KV dtype (raw bytes for the
state pools). The host side is judged item by item through each layout's logical shape
(``kv_pools.host_item``), the device side by bytes; slots not named must stay untouched.
"""

import os

if os.environ.get("SGLANG_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.layout import IOBackend
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.kv_pools import KV_DTYPES, as_bytes, host_item, make_device_pool, make_host_pool, randomize_pools, suite_device

register_cpu_ci(est_time=60, suite="per-commit-cpu")
register_cuda_ci(est_time=60, suite="per-commit-1-gpu")

DEVICE = suite_device()
CELLS = sorted(
    ((k, lay, io) for (k, lay, io) in IO_TABLE if k is not PoolKind.DSV4_ANCHOR),
    key=lambda c: (c[0].value, c[1].value, c[2].value),
)
STATE_KINDS = (PoolKind.MAMBA,)
SETTINGS = settings(
    max_examples=int(os.environ.get("SGLANG_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def transfer_case(draw, kind):
    page_size = 1 if kind in STATE_KINDS else draw(st.sampled_from([1, 2, 3, 8, 16, 64]))
    dev_pages = draw(st.integers(3, 6))
    n = draw(st.integers(1, dev_pages - 1))
    dtype = draw(st.sampled_from(KV_DTYPES))
    # device pages: page 0 is the reserved padding page, so use 1..dev_pages
    src_pages = draw(st.permutations(range(1, dev_pages + 1)))[:n]
    dst_pages = draw(st.permutations(range(1, dev_pages + 1)))[:n]
    host_perm = draw(st.permutations(range(2 * dev_pages)))
    layer_order = draw(st.permutations(range(2)))
    seed = draw(st.integers(0, 2**31 - 1))
    return page_size, dev_pages, dtype, src_pages, dst_pages, host_perm[:n], layer_order, seed


def slots(pages, page_size):
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64)


def run_case(kind, layout, io, case):
    page_size, dev_pages, dtype, src_pages, dst_pages, host_pages, layer_order, seed = case
    gen = torch.Generator().manual_seed(seed)
    src = make_device_pool(kind, dtype, page_size, dev_pages, 2, DEVICE)
    dst = make_device_pool(kind, dtype, page_size, dev_pages, 2, DEVICE)
    host = make_host_pool(src, layout, io)
    randomize_pools(gen, host, src, dst)
    host_before = {c.name: host.host_buffer(c.name).clone() for c in host.components}
    dst_before = {name: as_bytes(buf).clone() for name, buf in dst.buffers.items()}

    src_idx, dst_idx = slots(src_pages, page_size), slots(dst_pages, page_size)
    host_idx = slots(host_pages, page_size)
    host.backup_from_device_all_layer(src, host_idx, src_idx)
    for layer in layer_order:
        host.load_to_device_per_layer(dst, host_idx, dst_idx, layer)
    if DEVICE == "cuda":
        torch.cuda.synchronize()

    named = set(host_idx.tolist())
    for comp in host.components:
        for layer in range(host.layer_num):
            for h, s in zip(host_idx.tolist(), src_idx.tolist()):
                want = as_bytes(src.buffers[comp.name][layer, s])
                assert torch.equal(as_bytes(host_item(host, comp.name, h, layer)), want), (comp.name, layer, h)
        # host slots not named keep their old bytes
        before = SavedHost(host, host_before)
        for h in set(range(host.size)) - named:
            for layer in range(host.layer_num):
                got, old = host_item(host, comp.name, h, layer), host_item(before, comp.name, h, layer)
                assert torch.equal(as_bytes(got), as_bytes(old)), (comp.name, layer, h)
    for name, buf in dst.buffers.items():
        got = as_bytes(buf)
        want = dst_before[name].clone()
        want[:, dst_idx] = as_bytes(src.buffers[name])[:, src_idx]
        assert torch.equal(got, want), name


class SavedHost:
    """A host pool's buffers as they were before the transfer, addressable by ``host_item``."""

    def __init__(self, host, saved):
        self.page_size, self.layout, self._saved = host.page_size, host.layout, saved

    def host_buffer(self, name):
        return self._saved[name]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0].value}-{c[1].value}-{c[2].value}")
def test_round_trip(cell):
    kind, layout, io = cell

    @SETTINGS
    @given(case=transfer_case(kind))
    def check(case):
        run_case(kind, layout, io, case)

    check()


@pytest.mark.parametrize("io", list(IOBackend))
def test_logical_anchor_copies_are_noops(io):
    anchor = make_device_pool(PoolKind.DSV4_ANCHOR, page_size=4, num_pages=4, device=DEVICE)
    host = make_host_pool(anchor, "page_first_direct", io)
    idx = host.alloc(8)
    host.backup_from_device_all_layer(anchor, idx, torch.arange(4, 12))
    assert host.layer_num == 0  # no layer to load: the controller loads layer l only where l < layer_num
    assert host.get_data_page(0).numel() == 0
    assert host.get_page_buffer_meta(idx) == ([], [])
    assert host.get_size_per_token() == 0
