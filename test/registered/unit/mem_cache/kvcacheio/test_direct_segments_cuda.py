"""Direct IO on a GPU with real-model page sizes: device pools on CUDA, host pools pinned.

The CUDA twin of test_direct_segments.py. On a GPU the copies are asynchronous (non-blocking
copies between pinned host memory and the device, queued on the current stream), which the CPU
run cannot exercise. Before each copy the current stream is kept busy (``torch.cuda._sleep``),
so a routine that reads or writes host memory before its queued device work has run is caught
deterministically rather than by luck. Every cell the direct backend serves, both directions,
checked against a pure-torch reference after ``torch.cuda.synchronize()``; the row and segment
paths are cross-checked on the same data.
"""

import pytest

from sglang.test.cuda import require_cuda

require_cuda()

import torch  # noqa: E402

from sglang.srt.mem_cache.kvcacheio import direct  # noqa: E402
from sglang.srt.mem_cache.kvcacheio.dispatch import DIRECT  # noqa: E402
from sglang.srt.mem_cache.pool_host.layout import IOBackend  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402
from sglang.test.real_pools import (  # noqa: E402
    as_u8,
    randomized_real_pools,
    table_cells,
    to_logical,
)

register_cuda_ci(est_time=20, suite="per-commit-1-gpu")

SPIN_CYCLES = int(5e8)  # keeps the current stream busy well past any host-side work
DIRECT_CELLS, CELL_IDS = table_cells(IOBackend.DIRECT, DIRECT)


def busy_stream():
    torch.cuda._sleep(SPIN_CYCLES)


def setup(kind, layout, seed=0):
    return randomized_real_pools(kind, layout, "direct", "cuda", seed)


def host_bytes(host, name):
    return as_u8(to_logical(host.host_buffer(name), host.layout))


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_public_api_round_trip_on_cuda_matches_the_torch_reference(kind, layout):
    src, dst, host, h_idx, s_idx, d_idx = setup(kind, layout)
    assert all(c.buffer.pinned for c in host._host.values()), "host pools on a GPU are pinned by default"
    want_host = {c.name: host_bytes(host, c.name).clone() for c in host.components}
    for name, ref in want_host.items():
        ref[:, h_idx] = as_u8(src.buffers[name]).cpu()[:, s_idx]
    busy_stream()
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    torch.cuda.synchronize()
    for name, ref in want_host.items():
        assert torch.equal(host_bytes(host, name), ref), f"backup: {name}"

    before = {name: as_u8(buf).cpu() for name, buf in dst.buffers.items()}
    for layer in reversed(range(host.layer_num)):
        busy_stream()
        host.load_to_device_per_layer(dst, h_idx, d_idx, layer)
    torch.cuda.synchronize()
    for name, buf in dst.buffers.items():
        want = before[name].clone()
        want[:, d_idx] = as_u8(src.buffers[name]).cpu()[:, s_idx]
        assert torch.equal(as_u8(buf).cpu(), want), f"load: {name}"


def both_paths(src_t, dst_t, src_map, dst_map, src_slots, dst_slots, layers):
    src_off, dst_off, seg = direct._page_offsets(src_map, dst_map, src_slots, dst_slots, layers, src_t.element_size())
    by_rows, by_segments = dst_t.clone(), dst_t.clone()
    if not by_rows.is_cuda:  # host targets stay pinned, as the pool's are
        by_rows, by_segments = by_rows.pin_memory(), by_segments.pin_memory()
    torch.cuda.synchronize()
    busy_stream()
    direct.copy_rows(src_t, by_rows, src_off, dst_off, seg)
    busy_stream()
    direct.copy_segments(src_t, by_segments, *direct._merge(src_off, dst_off, seg))
    torch.cuda.synchronize()
    return as_u8(by_rows).cpu(), as_u8(by_segments).cpu()


@pytest.mark.parametrize("kind,layout", DIRECT_CELLS, ids=CELL_IDS)
def test_row_and_segment_paths_agree_on_cuda(kind, layout):
    src, dst, host, h_idx, s_idx, d_idx = setup(kind, layout, seed=1)
    for comp in host.components:
        io = host._specs_for(host.device_pool)[comp.name]
        rows, segs = both_paths(io.device, io.host, io.device_map, io.host_map, s_idx, h_idx, range(io.layer_num))
        ref = host_bytes(host, comp.name).clone()
        ref[:, h_idx] = as_u8(io.device).cpu()[:, s_idx]
        assert torch.equal(as_u8(to_logical(rows.view(io.host.dtype).view(io.host.shape), layout)), ref), comp.name
        assert torch.equal(rows, segs), f"backup: {comp.name}"
        io_dst = host._specs_for(dst)[comp.name]
        rows, segs = both_paths(io_dst.host, io_dst.device, io_dst.host_map, io_dst.device_map, h_idx, d_idx, range(1, 2))
        want = as_u8(io_dst.device).cpu()
        want[1, d_idx] = host_bytes(host, comp.name)[1, h_idx]
        assert torch.equal(rows.view(want.shape), want), f"load by rows: {comp.name}"
        assert torch.equal(rows, segs), f"load: {comp.name}"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
