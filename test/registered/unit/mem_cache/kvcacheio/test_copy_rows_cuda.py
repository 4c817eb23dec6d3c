"""Regression: ``direct.copy_rows`` from a CUDA tensor into host memory (DSA ``index_scale`` and
every component under 2 KiB per page and layer take this path on backup). The gathered rows
used to come back with ``non_blocking=True`` and be scattered on the CPU at once, before the
device had written them: stale bytes. The current stream is kept busy first
(``torch.cuda._sleep``), so a host read that does not wait for the copy sees the fill value."""

from sglang.test.cuda import require_cuda

require_cuda()

import torch  # noqa: E402

from sglang.srt.mem_cache.kvcacheio import direct  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=5, suite="per-commit-1-gpu")

SPIN_CYCLES = int(5e8)


def test_device_to_host_rows_have_landed_when_copy_rows_returns():
    seg, rows = 256, 64  # 256-byte rows: the DSA indexer scale's size per page and layer
    src = torch.randint(0, 256, (rows * seg,), dtype=torch.uint8, device="cuda")
    for pinned in (False, True):
        dst = torch.full((rows * seg,), 0xAB, dtype=torch.uint8).pin_memory() if pinned else \
            torch.full((rows * seg,), 0xAB, dtype=torch.uint8)
        src_off = torch.arange(rows - 1, -1, -1, dtype=torch.int64) * seg  # every row, reversed
        dst_off = torch.arange(rows, dtype=torch.int64) * seg
        torch.cuda._sleep(SPIN_CYCLES)  # the gather and its copy queue behind this
        direct.copy_rows(src, dst, src_off, dst_off, seg)
        got = dst.clone()  # read on the host right away, as the caller does
        want = src.view(rows, seg).flip(0).reshape(-1).cpu()
        assert torch.equal(got, want), f"pinned={pinned}: host read stale bytes"


def test_host_to_device_rows_round_trip():
    seg, rows = 512, 32
    src = torch.randint(0, 256, (rows * seg,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(rows * seg, dtype=torch.uint8, device="cuda")
    off = torch.arange(rows, dtype=torch.int64) * seg
    torch.cuda._sleep(SPIN_CYCLES)
    direct.copy_rows(src, dst, off, off.flip(0), seg)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(rows, seg).flip(0).reshape(-1).cpu(), src)
