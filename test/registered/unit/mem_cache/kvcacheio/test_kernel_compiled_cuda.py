"""The Triton copy kernel compiled for the GPU (no interpreter, no lock, no torch stand-in).

On CPU the kernel only ever runs under TRITON_INTERPRET=1, with other block sizes and behind a
lock; this is the compiled path. Every kernel cell of the IO table with real-model pools (pages
of >= 2 KiB per layer), both directions, against a pure-torch reference; the kernel and the
direct backend produce the same host bytes where both serve a layout; and the write and load
lanes (one CUDA stream each) interleave launches, as the controller does.
"""

import os

import pytest

from sglang.test.cuda import require_cuda

require_cuda()

import torch  # noqa: E402

from sglang.srt.mem_cache.kvcacheio import kernel  # noqa: E402
from sglang.srt.mem_cache.kvcacheio.dispatch import KERNEL  # noqa: E402
from sglang.srt.mem_cache.memory_pool import PoolKind  # noqa: E402
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend  # noqa: E402
from sglang.srt.mem_cache.controller.transfer_lane import make_lane  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402
from sglang.test.real_pools import (  # noqa: E402
    as_u8,
    randomized_real_pools,
    slots,
    table_cells,
    to_logical,
)

register_cuda_ci(est_time=40, suite="per-commit-1-gpu")

KERNEL_CELLS, CELL_IDS = table_cells(IOBackend.KERNEL, KERNEL)


def test_the_compiled_kernel_serves_cuda_tensors():
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: this file tests the compiled kernel"
    from sglang.srt.mem_cache.kvcacheio import triton_kernels

    assert not triton_kernels._INTERPRETED
    assert kernel.triton_usable(torch.device("cuda"))
    assert kernel.copy_fn(torch.device("cuda")) is triton_kernels.copy_items  # no interpreter lock


def setup(kind, layout, io="kernel", seed=0):
    return randomized_real_pools(kind, layout, io, "cuda", seed)


def host_bytes(host, name):
    return as_u8(to_logical(host.host_buffer(name), host.layout))


@pytest.mark.parametrize("kind,layout", KERNEL_CELLS, ids=CELL_IDS)
def test_compiled_round_trip_matches_the_torch_reference(kind, layout):
    src, dst, host, h_idx, s_idx, d_idx = setup(kind, layout)
    want_host = {c.name: host_bytes(host, c.name).clone() for c in host.components}
    for name, ref in want_host.items():
        ref[:, h_idx] = as_u8(src.buffers[name]).cpu()[:, s_idx]
    host.backup_from_device_all_layer(src, h_idx, s_idx)
    torch.cuda.synchronize()
    for name, ref in want_host.items():
        assert torch.equal(host_bytes(host, name), ref), f"backup: {name}"
    before = {name: as_u8(buf).cpu() for name, buf in dst.buffers.items()}
    host.load_to_device_per_layer(dst, h_idx, d_idx, 1)  # one layer: the others stay
    torch.cuda.synchronize()
    for name, buf in dst.buffers.items():
        want = before[name].clone()
        want[1, d_idx] = as_u8(src.buffers[name]).cpu()[1, s_idx]
        assert torch.equal(as_u8(buf).cpu(), want), f"load of layer 1: {name}"


@pytest.mark.parametrize("kind", sorted({k for k, lay in KERNEL_CELLS if lay is HostLayout.LAYER_FIRST}, key=lambda k: k.value),
                         ids=lambda k: k.value)
@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value)
def test_kernel_and_direct_write_the_same_host_bytes(kind, layout):
    out = {}
    for io in ("kernel", "direct"):
        src, _, host, h_idx, s_idx, _ = setup(kind, layout, io, seed=4)
        host.backup_from_device_all_layer(src, h_idx, s_idx)
        torch.cuda.synchronize()
        out[io] = {c.name: host_bytes(host, c.name)[:, h_idx] for c in host.components}
    for name in out["kernel"]:
        assert torch.equal(out["kernel"][name], out["direct"][name]), name


def test_write_and_load_lanes_interleave_on_their_own_streams():
    """What the controller does on a GPU: backups on the write lane's stream and layer loads on
    the load lane's stream, submitted alternately from one thread with no sync in between."""
    src, dst, host, _, _, _ = setup(PoolKind.MHA, HostLayout.PAGE_FIRST)
    P = host.page_size
    h_a, h_b = slots([0, 1, 2, 3], P), slots([8, 9, 10, 11], P)
    d_a, d_b = slots([1, 2, 3, 4], P), slots([5, 6, 7, 8], P)
    host.backup_from_device_all_layer(src, h_b, d_b)  # what the load lane reads
    torch.cuda.synchronize()
    write, load = make_lane("write", "cuda"), make_lane("load", "cuda")
    for _ in range(10):
        write.submit(lambda: host.backup_from_device_all_layer(src, h_a, d_a), [])
        for layer in range(host.layer_num):
            load.submit(lambda layer=layer: host.load_to_device_per_layer(dst, h_b, d_b, layer), [])
    assert write.error is None and load.error is None
    write.synchronize()
    load.synchronize()
    for name in ("k", "v"):
        logical = host_bytes(host, name)
        assert torch.equal(logical[:, h_a], as_u8(src.buffers[name]).cpu()[:, d_a]), name
        assert torch.equal(as_u8(dst.buffers[name]).cpu()[:, d_b], as_u8(src.buffers[name]).cpu()[:, d_b]), name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
