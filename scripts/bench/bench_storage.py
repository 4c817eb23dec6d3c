"""Set/get throughput of the L3 backends beside plain os.pwrite / os.pread of the same bytes.

    python scripts/bench/bench_storage.py [--page-kib 64 256 1024] [--pages 256] [--obj]
        [--direct] [--json out.json]

For each page size, an MLA host pool (one object per page, so the backend and the baseline
write the same number of files) is filled with random bytes; each backend stores and loads all
pages (``batch_set_v1`` / ``batch_get_v1``), and the baseline writes and reads one file per page
with ``os.open`` + ``os.pwrite`` / ``os.pread`` + ``os.close`` in the same run, interleaved,
best of ``--repeat``. Reads of both are served by the page cache unless O_DIRECT is on
(``--direct``: the NIXL POSIX backend with O_DIRECT against an O_DIRECT baseline).
``--obj`` adds NIXL OBJ against a local moto S3 server (its ratio is against local files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE_TOKENS = 64
S3 = {"access_key": "bench", "secret_key": "bench", "region": "us-east-1"}


def make_pool(page_bytes: int, num_pages: int) -> MLATokenToKVPoolHost:
    kv_dim = page_bytes // (PAGE_TOKENS * 2)  # bf16, one layer
    dev = MLATokenToKVPool(PAGE_TOKENS, PAGE_TOKENS, torch.bfloat16, kv_dim - 16, 16, 1)
    host = MLATokenToKVPoolHost(dev, 1.0, 0.0, PAGE_TOKENS, "page_first_direct", "direct", size=num_pages * PAGE_TOKENS)
    for buf in host.get_host_buffers():
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    assert host.page_bytes == page_bytes, (host.page_bytes, page_bytes)
    return host


def baseline(pages: list[memoryview], root: str, direct: bool) -> tuple[float, float]:
    """Seconds to write then read one file per page with plain os calls."""
    os.makedirs(root, exist_ok=True)
    flag = os.O_DIRECT if direct else 0
    paths = [os.path.join(root, f"{i}.bin") for i in range(len(pages))]
    t0 = time.perf_counter()
    for path, page in zip(paths, pages):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        os.pwrite(fd, page, 0)
        os.close(fd)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    for path, page in zip(paths, pages):
        fd = os.open(path, os.O_RDONLY | flag)
        if direct:  # O_DIRECT needs an aligned destination; os.pread's bytes object is not
            os.preadv(fd, [page], 0)
        else:
            os.pread(fd, len(page), 0)
        os.close(fd)
    return t1 - t0, time.perf_counter() - t2


def backend_times(store, host, keys) -> tuple[float, float]:
    idx = torch.arange(len(keys) * PAGE_TOKENS)
    t0 = time.perf_counter()
    ok_set = store.batch_set_v1(keys, idx)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    ok_get = store.batch_get_v1(keys, idx)
    t3 = time.perf_counter()
    if not (all(ok_set) and all(ok_get)):
        raise RuntimeError(f"{type(store).__name__}: set ok {sum(ok_set)}, get ok {sum(ok_get)} of {len(keys)}")
    return t1 - t0, t3 - t2


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def obj_extra(endpoint: str) -> dict:
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name=S3["region"], aws_access_key_id=S3["access_key"],
                 aws_secret_access_key=S3["secret_key"]).create_bucket(Bucket=bucket)
    params = {"bucket": bucket, "endpoint_override": endpoint, "scheme": "http", "use_virtual_addressing": "false"}
    return {"plugin": "obj", "plugin_params": {**params, **S3}}


def cases(args, root: str, endpoint: str | None) -> list[tuple[str, str, dict, bool]]:
    """(label, factory name, extra config, O_DIRECT) of every backend to measure."""
    out = [
        ("file", "file", {"storage_dir": f"{root}/file"}, False),
        ("nixl_posix", "nixl", {"storage_dir": f"{root}/nixl", "use_direct_io": "false"}, False),
    ]
    if args.direct:
        out.append(("nixl_posix_direct", "nixl", {"storage_dir": f"{root}/nixl_d", "use_direct_io": "true"}, True))
    if endpoint:
        out.append(("nixl_obj", "nixl", obj_extra(endpoint), False))
    return out


def measure(args, page_bytes: int, root: str, endpoint: str | None) -> list[dict]:
    host = make_pool(page_bytes, args.pages)
    pages = [memoryview(host.get_data_page(i * PAGE_TOKENS, flat=False)[0].numpy()) for i in range(args.pages)]
    records = []
    for label, name, extra, direct in cases(args, root, endpoint):
        cfg = HiCacheStorageConfig.from_cache_params(CacheInitParams(page_size=PAGE_TOKENS), host, "bench", extra)
        store = StorageBackendFactory.create_backend(name, cfg, host)
        best = {"set": (1e9, 1e9), "get": (1e9, 1e9)}  # op -> (backend s, baseline s)
        for rep in range(args.repeat):  # new keys and new baseline files every time, as in serving
            keys = page_hashes(list(range(args.pages * PAGE_TOKENS)), PAGE_TOKENS, namespace_hash(f"{label}-{rep}"))
            os.sync()  # each timed pass starts with no dirty pages from the other one
            b_set, b_get = baseline(pages, f"{root}/baseline-{label}-{rep}", direct)
            os.sync()
            s_set, s_get = backend_times(store, host, keys)
            best["set"] = (min(best["set"][0], s_set), min(best["set"][1], b_set))
            best["get"] = (min(best["get"][0], s_get), min(best["get"][1], b_get))
            shutil.rmtree(f"{root}/baseline-{label}-{rep}", ignore_errors=True)
        if label != "nixl_obj":  # NIXL cannot list or delete objects; the bucket is a fresh one
            store.clear()
        store.close()
        total = page_bytes * args.pages
        for op, (t_store, t_base) in best.items():
            gbps, base = total / t_store / 1e9, total / t_base / 1e9
            records.append({"backend": label, "op": op, "page_bytes": page_bytes, "gbps": round(gbps, 3),
                            "baseline_gbps": round(base, 3), "ratio": round(gbps / base, 3),
                            "pages": args.pages, "direct": direct})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    parser.add_argument("--obj", action="store_true", help="also NIXL OBJ against a local moto S3 server")
    parser.add_argument("--direct", action="store_true", help="also NIXL POSIX with O_DIRECT")
    parser.add_argument("--json", default=None, help="write the records to this file as a JSON list")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_storage_", dir="/tmp")
    moto, endpoint = start_moto() if args.obj else (None, None)
    records = []
    try:
        for kib in args.page_kib:
            records += measure(args, kib * 1024, os.path.join(root, f"{kib}k"), endpoint)
            shutil.rmtree(os.path.join(root, f"{kib}k"), ignore_errors=True)
    finally:
        if moto is not None:
            moto.terminate()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'backend':<18} {'op':<4} {'page':>8} {'GB/s':>8} {'plain GB/s':>11} {'ratio':>6}")
    for r in records:
        print(f"{r['backend']:<18} {r['op']:<4} {r['page_bytes'] // 1024:>6}Ki {r['gbps']:>8.3f} "
              f"{r['baseline_gbps']:>11.3f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
