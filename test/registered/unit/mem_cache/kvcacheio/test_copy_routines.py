"""Copy routines below the host pools: run coalescing, the torch stand-in, the CPU fallback."""

import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from sglang.srt.mem_cache.kvcacheio import gather, triton_kernels
from sglang.srt.mem_cache.kvcacheio.direct import contiguous_runs, page_segments
from sglang.srt.mem_cache.pool_host.layout import HostLayout, device_item_map, host_item_map, host_shape
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="per-commit-cpu")


def test_contiguous_runs_exact():
    src = torch.tensor([4, 5, 6, 10, 11, 0, 1, 2, 3])
    dst = torch.tensor([8, 9, 10, 11, 12, 20, 21, 30, 31])
    assert contiguous_runs(src, dst) == [(4, 8, 3), (10, 11, 2), (0, 20, 2), (2, 30, 2)]
    assert contiguous_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == []


def test_page_segments_one_copy_per_page_layer_merged_over_runs():
    """page_first_direct: one range per (page, layer); consecutive pages on both sides merge."""
    P, L, item = 4, 3, 16  # elements per token
    host = host_item_map(HostLayout.PAGE_FIRST_DIRECT, 32, L, P, (item,))
    dev = device_item_map(40, P, (item,), 1)
    page = P * item * 2  # bf16 bytes of one (page, layer)
    h = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 24, 25, 26, 27])  # host pages 1, 2, 6
    d = torch.tensor([12, 13, 14, 15, 16, 17, 18, 19, 4, 5, 6, 7])  # device pages 3, 4, 1
    src, dst, lengths = page_segments(host, dev, h, d, range(1, 2), 2)  # load layer 1
    # host pages 1, 2 are not adjacent within one layer (a page holds all L layers): no merge
    assert src == [(1 * L * P + 1 * P) * item * 2, (2 * L * P + 1 * P) * item * 2, (6 * L * P + 1 * P) * item * 2]
    assert dst == [(1 * 40 + 3 * P) * item * 2, (1 * 40 + 4 * P) * item * 2, (1 * 40 + 1 * P) * item * 2]
    assert lengths == [page] * 3
    lf = host_item_map(HostLayout.LAYER_FIRST, 32, L, P, (item,))
    src, dst, lengths = page_segments(dev, lf, d, h, range(L), 2)  # backup, all layers
    # layer_first: device pages 3,4 -> host pages 1,2 are adjacent on both sides: one range per layer
    assert lengths == [2 * page, page] * L
    assert src[:2] == [3 * P * item * 2, 1 * P * item * 2]
    assert dst[:2] == [1 * P * item * 2, 6 * P * item * 2]


def _case(layout, P=4, L=3, item=(2, 6), slots_host=24, slots_dev=20, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(-30000, 30000, host_shape(layout, slots_host, L, P, item), generator=gen).to(dtype)
    dev = torch.randint(-30000, 30000, (L, slots_dev, *item), generator=gen).to(dtype)
    chunks = item[0] if layout is HostLayout.PAGE_HEAD else 1
    hmap = host_item_map(layout, slots_host, L, P, item)
    dmap = device_item_map(slots_dev, P, item, chunks)
    h_slots = torch.tensor([16, 17, 18, 19, 4, 5, 6, 7])
    d_slots = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15])
    return host, dev, hmap, dmap, h_slots, d_slots


def test_gather_matches_triton_for_every_layout():
    for layout in HostLayout:
        outs = []
        for impl in (gather.copy_items, triton_kernels.copy_items):
            host, dev, hmap, dmap, hs, ds = _case(layout)
            impl(dev, host, dmap, hmap, ds, hs, 0, 3)  # backup all layers
            impl(host, dev, hmap, dmap, hs.flip(0), ds, 1, 1)  # load layer 1, permuted
            outs.append((host.clone(), dev.clone()))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), layout


def test_kernel_without_interpreter_falls_back_with_one_warning():
    code = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        dev = MHATokenToKVPool(16, 4, torch.float16, 2, 8, 2)
        dev.buffers["k"].normal_(); dev.buffers["v"].normal_()
        host = MHATokenToKVPoolHost(dev, 2.0, layout="page_first", io_backend="kernel")
        for _ in range(3):
            host.backup_from_device_all_layer(dev, torch.arange(0, 8), torch.arange(4, 12))
        out = MHATokenToKVPool(16, 4, torch.float16, 2, 8, 2)
        for layer in range(2):
            host.load_to_device_per_layer(out, torch.arange(0, 8), torch.arange(8, 16), layer)
        assert torch.equal(out.buffers["k"][:, 8:16], dev.buffers["k"][:, 4:12])
        assert torch.equal(out.buffers["v"][:, 8:16], dev.buffers["v"][:, 4:12])
        import sys; print("triton" in sys.modules)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("without a GPU and without TRITON_INTERPRET=1") == 1
    assert res.stdout.strip() == "False"  # Triton was never imported


def test_interpreted_kernel_is_safe_from_two_threads():
    """Regression: the write and load lanes launch kernels concurrently; under Triton's
    interpreter that used to fail ("Did you forget to add @triton.jit")."""
    import threading

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(64, 4, torch.float16, 2, 8, 2)
    dev.buffers["k"].normal_()
    dev.buffers["v"].normal_()
    host = MHATokenToKVPoolHost(dev, 2.0, layout="page_first", io_backend="kernel")
    out = MHATokenToKVPool(64, 4, torch.float16, 2, 8, 2)
    host.backup_from_device_all_layer(dev, torch.arange(64, 128), torch.arange(4, 68))
    errors = []

    def run(fn):
        try:
            for _ in range(15):
                fn()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    writer = threading.Thread(target=run, args=(lambda: host.backup_from_device_all_layer(dev, torch.arange(0, 64), torch.arange(4, 68)),))
    loader = threading.Thread(
        target=run, args=(lambda: [host.load_to_device_per_layer(out, torch.arange(64, 128), torch.arange(4, 68), l) for l in range(2)],)
    )
    writer.start(), loader.start()
    writer.join(120), loader.join(120)
    assert not errors, errors
    assert torch.equal(out.buffers["k"][:, 4:68], dev.buffers["k"][:, 4:68])
    assert torch.equal(host.host_buffer("k")[0:64], host.host_buffer("k")[64:128])
