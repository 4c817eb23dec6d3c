"""Pinned host memory on a GPU: HostBuffer registers its page-aligned mmap with
cudaHostRegister, host pools on a CUDA device pool pin by default, and ``destroy`` unregisters.

The CPU suite only ever builds unpinned buffers (pinning needs a CUDA driver); this is the
path every GPU deployment takes.
"""

import pytest

from sglang.test.cuda import require_cuda

require_cuda()

import torch  # noqa: E402

from sglang.srt.mem_cache.memory_pool import PoolKind  # noqa: E402
from sglang.srt.mem_cache.pool_host.layout import HostLayout  # noqa: E402
from sglang.srt.mem_cache.pool_host.memory import HostBuffer  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402
from sglang.test.kv_pools import make_host_pool, randomize_bytes  # noqa: E402
from sglang.test.real_pools import HOST_PAGES, SRC_PAGES, as_u8, make_real_pool, slots, to_logical  # noqa: E402

register_cuda_ci(est_time=10, suite="per-commit-1-gpu")


def test_host_buffer_is_registered_aligned_and_unregistered_on_release():
    buf = HostBuffer(3 * 4096 + 100, pin_memory=True)
    assert buf.pinned and buf.tensor.is_pinned()
    assert buf.tensor.data_ptr() % 4096 == 0 and buf.tensor.numel() == 3 * 4096 + 100
    buf.release()
    assert not buf.pinned and not buf.tensor.is_pinned()
    buf.release()  # idempotent
    plain = HostBuffer(4096, pin_memory=False)
    assert not plain.pinned and not plain.tensor.is_pinned()
    empty = HostBuffer(0, pin_memory=True)  # nothing to register
    assert not empty.pinned and empty.tensor.numel() == 0


def test_non_blocking_copies_from_a_pinned_buffer_land_after_sync():
    buf = HostBuffer(8 << 20, pin_memory=True)
    src = buf.tensor
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    dev = torch.empty_like(src, device="cuda")
    torch.cuda._sleep(int(5e8))  # the copy queues behind this
    dev.copy_(src, non_blocking=True)
    back = torch.empty(src.numel(), dtype=torch.uint8).pin_memory()
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    buf.release()


@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_HEAD],
                         ids=lambda x: x.value)
def test_host_pool_on_a_gpu_pins_by_default_and_destroy_unpins(layout):
    dev = make_real_pool(PoolKind.MHA, "cuda")
    io = "kernel" if layout is HostLayout.PAGE_HEAD else "direct"
    host = make_host_pool(dev, layout, io)
    assert host.pin_memory
    assert all(c.buffer.pinned and c.raw.is_pinned() for c in host._host.values())
    assert host.is_stride_page_aligned(4096)  # 32 KiB (page, layer) runs in mmap'd buffers
    pools = [host]
    if io == "direct":  # copies from pageable memory work too (the kernel needs mapped memory)
        pools.append(make_host_pool(dev, layout, io, pin_memory=False))
        assert not any(c.buffer.pinned for c in pools[1]._host.values())
    for pool in pools:  # every pool round-trips the same bytes
        gen = torch.Generator().manual_seed(2)
        for buf in dev.buffers.values():
            randomize_bytes(buf, gen)
        P = pool.page_size
        h_idx, d_idx = slots(HOST_PAGES, P), slots(SRC_PAGES, P)
        pool.backup_from_device_all_layer(dev, h_idx, d_idx)
        torch.cuda.synchronize()
        for name in ("k", "v"):
            got = as_u8(to_logical(pool.host_buffer(name), pool.layout))[:, h_idx]
            assert torch.equal(got, as_u8(dev.buffers[name]).cpu()[:, d_idx]), (name, pool.pin_memory)
    host.destroy()
    assert not any(c.buffer.pinned or c.raw.is_pinned() for c in host._host.values())
    for pool in pools:
        pool.destroy()  # idempotent for the pinned one


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
