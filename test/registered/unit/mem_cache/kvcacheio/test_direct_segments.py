"""Direct IO with real-model page sizes: the large-range (segment) path, checked three ways.

Every pool here has pages of >= 2 KiB per layer for its KV components (what every real model
has: Llama-style MHA, an asymmetric K/V pool, DeepSeek MLA, Mamba states, the DSA indexer, the
DeepSeek-V4 state), several layers, and both host layouts the direct backend serves. Small
sidecar components (a 4-byte indexer scale, a narrow conv state) stay on the row path in the
same pool. Each cell is checked:

1. through the public pool API (``backup_from_device_all_layer``, ``load_to_device_per_layer``)
   against a pure-torch reference (the host buffer viewed as (layer, slot, *item) through its
   logical shape, indexed with the slot lists), untouched slots and layers included;
2. by forcing the row path and the segment path on the same data and comparing bytes;
3. with many scattered pages in one call, and with backups and loads running concurrently.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang.srt.mem_cache.kvcacheio import direct
from sglang.srt.mem_cache.kvcacheio.dispatch import DIRECT
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_host_pool, randomize_bytes
from sglang.test.real_pools import (
    BF16,
    HOST_PAGES,
    REAL_KINDS,
    as_u8,
    make_real_pool,
    randomized_real_pools,
    slots,
    table_cells,
    to_logical,
)
from sglang.test.threads import run_in_threads

register_cpu_ci(est_time=10, suite="per-commit-cpu")

DIRECT_CELLS, CELL_IDS = table_cells(IOBackend.DIRECT, DIRECT)


def test_every_direct_cell_is_covered_and_takes_real_pages():
    assert {k for k, _ in DIRECT_CELLS} == set(REAL_KINDS)
    assert {lay for _, lay in DIRECT_CELLS} == {HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT}
    # the rule: every page of >= 2 KiB per layer takes the segment path
    assert direct._ROW_COPY_MAX_BYTES <= 2048
    for kind in REAL_KINDS:
        pool = make_real_pool(kind)
        big = [c for c in pool.components if pool.page_size * c.item_bytes >= 2048]
        assert big and pool.layer_num >= 3, kind


def logical(host, name):
    return to_logical(host.host_buffer(name), host.layout)


def setup(kind, layout, seed=0):
    return randomized_real_pools(kind, layout, seed=seed)


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_public_api_round_trip_matches_the_torch_reference(kind, layout):
    src, dst, host, h_idx, s_idx, d_idx = setup(kind, layout)
    want_host = {c.name: as_u8(logical(host, c.name)).clone() for c in host.components}
    for name, ref in want_host.items():
        ref[:, h_idx] = as_u8(src.buffers[name])[:, s_idx]
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    for name, ref in want_host.items():
        assert torch.equal(as_u8(logical(host, name)), ref), f"backup: {name}"

    before = {name: as_u8(buf).clone() for name, buf in dst.buffers.items()}
    for step, layer in enumerate(reversed(range(host.layer_num))):  # any layer order
        host.load_to_device_per_layer(dst, h_idx, d_idx, layer)
        for name, buf in dst.buffers.items():
            want = before[name].clone()
            for done in list(reversed(range(host.layer_num)))[: step + 1]:
                want[done, d_idx] = as_u8(src.buffers[name])[done, s_idx]
            assert torch.equal(as_u8(buf), want), f"load of layer {layer}: {name}"


def spy(monkeypatch):
    """Count calls and bytes of the two internal paths while they still run (CPU copies are
    routed through them, as device copies are)."""
    monkeypatch.setattr(direct, "CPU_PAGE_ROWS", False)
    calls = {"rows": [], "segments": []}
    rows, segments = direct.copy_rows, direct.copy_segments

    def spy_rows(src, dst, src_off, dst_off, seg):
        calls["rows"].append(seg)
        return rows(src, dst, src_off, dst_off, seg)

    def spy_segments(src, dst, src_off, dst_off, lengths):
        calls["segments"].append(list(lengths))
        return segments(src, dst, src_off, dst_off, lengths)

    monkeypatch.setattr(direct, "copy_rows", spy_rows)
    monkeypatch.setattr(direct, "copy_segments", spy_segments)
    return calls


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_large_pages_go_through_segments_and_small_ones_through_rows(kind, layout, monkeypatch):
    src, _, host, h_idx, s_idx, _ = setup(kind, layout)
    calls = spy(monkeypatch)
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    page_bytes = [host.page_size * c.item_bytes for c in host.components]
    big = [b for b in page_bytes if b >= direct._ROW_COPY_MAX_BYTES]
    assert sorted(calls["rows"]) == sorted(b for b in page_bytes if b < direct._ROW_COPY_MAX_BYTES)
    assert len(calls["segments"]) == len(big)
    moved = sorted(sum(lengths) for lengths in calls["segments"])
    assert moved == sorted(b * len(HOST_PAGES) * host.layer_num for b in big)  # every byte, once
    if layout is HostLayout.LAYER_FIRST:  # the run of three pages is one range per layer
        for lengths, b in zip(calls["segments"], [b for b in page_bytes if b in big]):
            assert 3 * b in lengths


def both_paths(src_t, dst_t, src_map, dst_map, src_slots, dst_slots, layers):
    """The same copy by rows and by segments, each into its own clone of ``dst_t``."""
    src_off, dst_off, seg = direct._page_offsets(src_map, dst_map, src_slots, dst_slots, layers, src_t.element_size())
    by_rows, by_segments = dst_t.clone(), dst_t.clone()
    direct.copy_rows(src_t, by_rows, src_off, dst_off, seg)
    direct.copy_segments(src_t, by_segments, *direct._merge(src_off, dst_off, seg))
    return by_rows, by_segments


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_row_and_segment_paths_agree_on_the_same_data(kind, layout):
    src, dst, host, h_idx, s_idx, d_idx = setup(kind, layout, seed=1)
    for comp in host.components:
        io = host._specs_for(host.device_pool)[comp.name]
        # backup direction: device -> host, every layer
        rows, segs = both_paths(io.device, io.host, io.device_map, io.host_map, s_idx, h_idx, range(io.layer_num))
        assert torch.equal(as_u8(rows), as_u8(segs)), f"backup: {comp.name}"
        ref = as_u8(logical(host, comp.name)).clone()
        ref[:, h_idx] = as_u8(io.device)[:, s_idx]
        assert torch.equal(as_u8(to_logical(rows, layout)), ref), f"backup vs reference: {comp.name}"
        # load direction: host -> device, one layer
        io_dst = host._specs_for(dst)[comp.name]
        rows, segs = both_paths(io_dst.host, io_dst.device, io_dst.host_map, io_dst.device_map, h_idx, d_idx, range(1, 2))
        assert torch.equal(as_u8(rows), as_u8(segs)), f"load: {comp.name}"
        want = as_u8(io_dst.device).clone()
        want[1, d_idx] = as_u8(logical(host, comp.name))[1, h_idx]
        assert torch.equal(as_u8(segs), want), f"load vs reference: {comp.name}"


@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value)
def test_many_pages_in_pieces_and_concurrent_lanes(layout, monkeypatch):
    """24 scattered pages x 8 layers of K and V (6 MiB a component and direction) in one call,
    staged in 1 MiB pieces where the routine stages; a backup and a load run at once on
    disjoint host slots (what the write and load lanes do), five times each."""
    monkeypatch.setattr(direct, "_STAGE_BYTES", 1 << 20, raising=False)
    make = lambda: MHATokenToKVPool(32 * 16, 16, BF16, 8, 128, 8)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    src, dst = make(), make()
    for pool in (src, dst):
        for buf in pool.buffers.values():
            randomize_bytes(buf, gen)
    host = make_host_pool(src, layout, "direct")
    perm = torch.randperm(64, generator=gen)
    backup_pages, load_pages = perm[:24].tolist(), perm[24:48].tolist()
    dev_pages = (torch.randperm(32, generator=gen) + 1)[:24].tolist()
    P = host.page_size
    h_load, h_backup, d_idx = slots(load_pages, P), slots(backup_pages, P), slots(dev_pages, P)
    host.backup_from_device_all_layer(src, h_load, d_idx)  # what the load lane will read
    d_out = slots(sorted(dev_pages), P)

    def backup():
        for _ in range(5):
            host.backup_from_device_all_layer(src, h_backup, d_idx)

    def load():
        for _ in range(5):
            for layer in range(host.layer_num):
                host.load_to_device_per_layer(dst, h_load, d_out, layer)

    run_in_threads([backup, load], timeout_s=120)
    for name in ("k", "v"):
        ref = as_u8(src.buffers[name])[:, d_idx]
        assert torch.equal(as_u8(logical(host, name))[:, h_backup], ref), name
        assert torch.equal(as_u8(logical(host, name))[:, h_load], ref), name
        assert torch.equal(as_u8(dst.buffers[name])[:, d_out], ref), name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
