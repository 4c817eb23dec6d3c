"""Throughput of device <-> host KV copies for every (kind, layout, io_backend) cell.

For each cell: back up ``--pages`` scattered pages (device -> host, all layers) and load them
back (host -> device, layer by layer), and in the same run time a plain contiguous
``Tensor.copy_`` of the same number of bytes between the same two memories, alternating the
two. Prints GB/s and the median per-round ratio to that baseline; ``--json FILE`` writes one
record per case. ``impl`` names the routine: on CPU, ``direct`` moves every range of a job in
one native call (``kvcacheio/csrc/native_copy.c``) when that helper is built.

    python scripts/bench/bench_kvcacheio.py [--device cpu|cuda] [--pages 256] [--json out.json]

On CPU the ``kernel`` cells would run Triton's interpreter (under ``TRITON_INTERPRET=1``) or
the torch stand-in: neither is a benchmark, so they are skipped unless ``--cpu-kernel-cells``,
and then the record's ``impl`` says which routine ran ("triton-interpreter (not a benchmark)").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang.srt.mem_cache.kvcacheio import direct  # noqa: E402
from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE  # noqa: E402
from sglang.srt.mem_cache.kvcacheio.kernel import triton_usable  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    AsymmetricMHATokenToKVPool,
    DeepSeekV4StatePool,
    DSAIndexerPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PoolKind,
)
from sglang.test.kv_pools import make_host_pool  # noqa: E402


def device_pool(kind: PoolKind, page_size: int, num_pages: int, layers: int, device: str):
    size = page_size * num_pages
    bf16 = torch.bfloat16
    builders = {
        PoolKind.MHA: lambda: MHATokenToKVPool(size, page_size, bf16, 8, 128, layers, device),
        PoolKind.MLA: lambda: MLATokenToKVPool(size, page_size, bf16, 512, 64, layers, device),
        PoolKind.ASYMMETRIC_MHA: lambda: AsymmetricMHATokenToKVPool(size, page_size, bf16, 8, 192, 128, layers, device),
        PoolKind.DSA_INDEXER: lambda: DSAIndexerPool(size, page_size, 128, layers, bf16, device),
        PoolKind.DSV4_STATE: lambda: DeepSeekV4StatePool(size, page_size, 512, layers, bf16, device),
        PoolKind.MAMBA: lambda: MambaPool(num_pages, [(4, 4096)], (32, 64, 64), layers, bf16, torch.float32, device),
    }
    return builders[kind]()


def chunk_bytes(host) -> int:
    """Smallest contiguous piece a direct copy moves: one page of one layer of one component."""
    return min(c.item_bytes for c in host.components) * host.page_size


def timed_pair(fn, base, device: str, repeat: int) -> tuple[float, float, float]:
    """Median seconds of ``fn`` and of ``base`` and the median of their per-round ratio, over
    ``repeat`` rounds that run one after the other (after one warm-up each), so a neighbour that
    slows the machine for a while slows both sides of a round."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(f) -> float:
        t0 = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - t0

    once(fn), once(base)
    ours, theirs = [], []
    for _ in range(repeat):
        ours.append(once(fn))
        theirs.append(once(base))
    ratio = statistics.median(b / a for a, b in zip(ours, theirs))
    return statistics.median(ours), statistics.median(theirs), ratio


def num_pages_for(kind, args) -> int:
    """``--pages``, raised so that at least ``--min-mib`` move: a smaller working set would sit
    in the CPU cache and flatter the baseline."""
    P = 1 if kind is PoolKind.MAMBA else args.page_size
    probe = device_pool(kind, P, 1, args.layers, "cpu")
    page_bytes = probe.get_size_per_token() * P
    return max(args.pages, -(-(args.min_mib << 20) // page_bytes))


def bench_cell(kind, layout, io, args, gen):
    P = 1 if kind is PoolKind.MAMBA else args.page_size
    n = num_pages_for(kind, args)
    dev = device_pool(kind, P, n + 1, args.layers, args.device)
    host = make_host_pool(dev, layout, io, 1.0)
    dev_pages = torch.randperm(n, generator=gen) + 1  # scattered, never the padding page
    host_pages = torch.randperm(host.page_num, generator=gen)[:n]
    offs = torch.arange(P)
    dev_idx = (dev_pages[:, None] * P + offs).reshape(-1)
    host_idx = (host_pages[:, None] * P + offs).reshape(-1)
    nbytes = n * host.page_bytes
    pin = args.device == "cuda"
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def backup():
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)

    def load():
        for layer in range(host.layer_num):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)

    if io.value == "direct" or dev.device.type == "cuda":
        impl = host.io.name
        if io.value == "direct" and dev.device.type == "cpu":
            impl += "+native" if direct.NATIVE_COPY else "+torch"
    else:
        impl = "triton-interpreter (not a benchmark)" if triton_usable(dev.device) else "torch-gather (no GPU)"
    rows = []
    for direction, fn, base in (
        ("backup", backup, lambda: flat_host.copy_(flat_dev, non_blocking=True)),
        ("load", load, lambda: flat_dev.copy_(flat_host, non_blocking=True)),
    ):
        t, tb, ratio = timed_pair(fn, base, args.device, args.repeat)
        gbps, base_gbps = nbytes / t / 1e9, nbytes / tb / 1e9
        rows.append(
            dict(kind=kind.value, layout=layout.value, io_backend=io.value, direction=direction,
                 page_bytes=host.page_bytes, gbps=round(gbps, 3), baseline_gbps=round(base_gbps, 3),
                 ratio=round(ratio, 3), impl=impl, chunk_bytes=chunk_bytes(host), pages=n)
        )
    host.destroy()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pages", type=int, default=256, help="pages moved per call (scattered), at least")
    parser.add_argument("--min-mib", type=int, default=256, help="move at least this many MiB per call")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (Mamba: 1 slot)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--kinds", default=",".join(k.value for k in PoolKind if k is not PoolKind.DSV4_ANCHOR))
    parser.add_argument("--cpu-kernel-cells", action="store_true", help="also time kernel cells without a GPU")
    parser.add_argument("--json", help="write the records to this file as a JSON list")
    args = parser.parse_args()
    kinds = {PoolKind(k) for k in args.kinds.split(",")}
    gen = torch.Generator().manual_seed(0)
    records = []
    print(f"{'kind':15} {'layout':18} {'io':7} {'dir':7} {'page KiB':>9} {'chunk KiB':>9} {'GB/s':>8} {'base':>8} "
          f"{'ratio':>6}  impl")
    for kind, layout, io in sorted(IO_TABLE, key=lambda c: (c[0].value, c[1].value, c[2].value)):
        if kind not in kinds:
            continue
        # Without a GPU a kernel cell runs Triton's interpreter (TRITON_INTERPRET=1, ~0.07 GB/s:
        # hours at the default size) or the torch stand-in: neither is the kernel's speed.
        if io.value == "kernel" and torch.device(args.device).type != "cuda" and not args.cpu_kernel_cells:
            continue
        for r in bench_cell(kind, layout, io, args, gen):
            records.append(r)
            print(f"{r['kind']:15} {r['layout']:18} {r['io_backend']:7} {r['direction']:7} "
                  f"{r['page_bytes'] / 1024:9.1f} {r['chunk_bytes'] / 1024:9.2f} {r['gbps']:8.2f} "
                  f"{r['baseline_gbps']:8.2f} {r['ratio']:6.2f}  {r['impl']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
