"""Set/get throughput of the L3 backends beside plain os.pwrite / os.pread of the same bytes.

    python scripts/bench/bench_storage.py [--page-kib 64 256 1024] [--pages 256] [--repeat 5]
        [--warmup 1] [--obj] [--direct] [--mooncake] [--only ROW ...] [--json out.json]

For each page size, an MLA host pool (one object per page, so the backend and the baseline
write the same number of files) is filled with random bytes. Each backend stores and loads all
pages (``batch_set_v1`` / ``batch_get_v1``); the baseline writes one file per page with
``os.open`` + ``os.pwrite`` + ``os.close`` and reads it back with ``os.open`` + ``os.preadv``
into the same host pages + ``os.close``, in the same run. Like with like:

* the same source and destination memory: both read into the host pool's pages (a baseline that
  reads into one recycled buffer keeps its destination in the CPU cache and measured up to 4x
  the copy bandwidth the host pool can take);
* the same page-cache and file-system state: every repetition writes new files on both sides,
  under the same kind of directory tree (256 persistent buckets), and deletes both sides' files
  afterwards (memory the page cache recycles is several times faster to fill than memory touched
  for the first time, notably in VMs), with ``--warmup`` untimed repetitions first; the order of
  the two sides alternates between repetitions;
* the same flush policy: no fsync on either side, ``os.sync()`` before each timed pass, reads
  served by the page cache unless O_DIRECT is on (``--direct``: the NIXL POSIX backend with
  O_DIRECT against an O_DIRECT baseline).

A ``nixl_raw`` row (unless ``--no-raw-nixl``) moves the baseline's files with a bare NIXL POSIX
agent (one registration and one transfer of all pages, busy-polled): what NIXL itself costs,
so a NIXL row's gap to the baseline splits into NIXL's part and the backend's part. A
``nixl_raw_hashed`` row adds the XXH3 pass over the pages read (with the native helper): the
ceiling of a NIXL backend that verifies what it reads (its set row is ``nixl_raw``'s again).

All backends of a page size and ONE baseline run in every repetition, in an order rotated
between repetitions, so they share the machine's state (an earlier version timed a separate
baseline beside each backend, and two of those baselines moving the same bytes differed 3x).
The headline ``ratio`` is the median of the per-repetition ratios (baseline time / backend
time: the sides of a repetition run close together, so a load that drifts between repetitions
cancels); the best of each side and best-over-best follow, then ``cpu`` the paired median on the
CPU seconds of the process (on a shared machine the least noisy view of the work done; not
meaningful for O_DIRECT, which waits on the device). ``--obj`` adds NIXL OBJ against a local
moto S3 server (its ratio is against local files). ``--mooncake`` adds the Mooncake backend against a
local ``mooncake_master`` (TCP on 127.0.0.1), its pages held by a separate client that contributes
the store's only segment (the shared-L3 case: every page crosses the transfer engine), and two bare
clients moving the same pages (no key derivation, trailer, size query or check): ``mooncake_raw``
through ``batch_put_from`` / ``batch_get_into`` (one call each), and ``mooncake_raw_ranged`` through
the session API the backend uses (session start, one ranged call, session end). The ``mooncake``
row is printed twice, once against each (ours / raw); the two raw rows against local files. The
``versus`` column names the side a row is compared with. ``--only ROW...`` measures only those
backend rows (and what they are compared with). The load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

import torch

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import native_io
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE_TOKENS = 64
S3 = {"access_key": "bench", "secret_key": "bench", "region": "us-east-1"}


def make_pool(page_bytes: int, num_pages: int) -> MLATokenToKVPoolHost:
    kv_dim = page_bytes // (PAGE_TOKENS * 2)  # bf16, one layer
    dev = MLATokenToKVPool(PAGE_TOKENS, PAGE_TOKENS, torch.bfloat16, kv_dim - 16, 16, 1)
    host = MLATokenToKVPoolHost(dev, 1.0, 0.0, PAGE_TOKENS, "page_first_direct", io_backend="direct",
                                size=num_pages * PAGE_TOKENS)
    for buf in host.get_host_buffers():
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    assert host.page_bytes == page_bytes, (host.page_bytes, page_bytes)
    return host


class Baseline:
    """One file per page with plain os calls, from and into the host pool's pages, laid out like
    the backends' files: random hex names in 256 bucket directories that persist across
    repetitions (ext4 allocates inodes far slower in a directory with many recently deleted
    files than in a new one, so a baseline writing into a fresh directory each time would gain
    on the file system, not on the bytes)."""

    def __init__(self, pages: list[memoryview], root: str, direct: bool):
        self.pages, self.root, self.flag = pages, root, os.O_DIRECT if direct else 0
        for i in range(256):
            os.makedirs(f"{root}/{i:02x}", exist_ok=True)
        self.paths = {}

    def _paths(self, rep: int) -> list[str]:
        if rep not in self.paths:
            names = [uuid.uuid4().hex * 2 for _ in self.pages]
            self.paths[rep] = [f"{self.root}/{n[:2]}/{n}.bin" for n in names]
        return self.paths[rep]

    def set(self, rep: int) -> None:
        for path, page in zip(self._paths(rep), self.pages):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flag, 0o644)
            os.pwrite(fd, page, 0)
            os.close(fd)

    def get(self, rep: int) -> None:
        for path, page in zip(self._paths(rep), self.pages):
            fd = os.open(path, os.O_RDONLY | self.flag)
            if os.preadv(fd, [page], 0) != len(page):
                raise RuntimeError("baseline: short read")
            os.close(fd)

    def clear(self, rep: int) -> None:
        for path in self.paths.pop(rep, []):
            os.unlink(path)


class RawNixl(Baseline):
    """The same files as the baseline, moved by a bare NIXL POSIX agent: register the files
    (FILE descriptors at offset 0), one transfer of every page, polled to completion. No key,
    trailer, checksum or existence check: the floor a NIXL backend cannot go below, so the
    NIXL rows can be read as (ours / raw NIXL) x (raw NIXL / plain)."""

    def __init__(self, pages: list[memoryview], root: str, direct: bool, host):
        super().__init__(pages, root, direct)
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"bench-raw-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX", {"use_direct_io": "true" if direct else "false"})
        self.dram = [(host.get_data_page(i * PAGE_TOKENS, flat=False)[0].data_ptr(), len(p), 0)
                     for i, p in enumerate(pages)]
        self.dram_reg = self.agent.register_memory([(*d, "") for d in self.dram], "DRAM")

    def _move(self, rep: int, op: str, flags: int) -> None:
        fds = [os.open(path, flags | self.flag, 0o644) for path in self._paths(rep)]
        try:
            files = [(0, d[1], fd, "") for d, fd in zip(self.dram, fds)]
            reg = self.agent.register_memory(files, "FILE")
            try:
                local = self.agent.get_xfer_descs(self.dram, "DRAM")
                remote = self.agent.get_xfer_descs([(0, d[1], fd) for d, fd in zip(self.dram, fds)], "FILE")
                handle = self.agent.initialize_xfer(op, local, remote, self.agent.name)
                state = self.agent.transfer(handle)
                while state not in ("DONE", "ERR"):
                    state = self.agent.check_xfer_state(handle)
                if state == "ERR":
                    raise RuntimeError(f"raw NIXL {op} failed")
                self.agent.release_xfer_handle(handle)
            finally:
                self.agent.deregister_memory(reg)
        finally:
            for fd in fds:
                os.close(fd)

    def set(self, rep: int) -> None:
        self._move(rep, "WRITE", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def get(self, rep: int) -> None:
        self._move(rep, "READ", os.O_RDONLY)

    def close(self) -> None:
        self.agent.deregister_memory(self.dram_reg)


class RawNixlHashed(RawNixl):
    """``nixl_raw`` plus the one integrity pass no verified read can skip: an XXH3 hash of
    every page read (the native helper's, as the backends use), after the whole transfer. The
    ceiling of any NIXL backend that checks what it reads, since NIXL writes the pages and only
    then can they be hashed."""

    def __init__(self, pages: list[memoryview], root: str, direct: bool, host):
        super().__init__(pages, root, direct, host)
        self._iov = native_io.Iovecs(np.array([d[0] for d in self.dram], dtype=np.int64),
                                     np.array([d[1] for d in self.dram], dtype=np.int64),
                                     np.arange(len(self.dram) + 1, dtype=np.int64))

    def get(self, rep: int) -> None:
        super().get(rep)
        native_io.hash_objects(self._iov)


class RawMooncake:
    """The same pages through a bare Mooncake client: one ``batch_put_from`` / ``batch_get_into``
    of every page's host memory (registered), fresh keys every repetition. What Mooncake itself
    costs: the ``mooncake`` row's ratio against it is ours / raw."""

    def __init__(self, host, pages: list[memoryview], master):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        code = self.store.setup("127.0.0.1", master.metadata_server, 0, 16 << 20, "tcp", "",
                                master.master_server_address)
        if code != 0:
            raise RuntimeError(f"raw Mooncake client: setup failed ({code})")
        for buf in host.get_host_buffers():
            self.store.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
        self.ptrs = [host.get_data_page(i * PAGE_TOKENS, flat=False)[0].data_ptr() for i in range(len(pages))]
        self.sizes = [len(p) for p in pages]
        self.keys = {}

    def _keys(self, rep: int) -> list[str]:
        if rep not in self.keys:
            self.keys[rep] = [f"bench-raw/{uuid.uuid4().hex}" for _ in self.ptrs]
        return self.keys[rep]

    def set(self, rep: int) -> None:
        codes = self.store.batch_put_from(self._keys(rep), self.ptrs, self.sizes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"raw Mooncake put: {sorted(set(codes))}")

    def get(self, rep: int) -> None:
        codes = self.store.batch_get_into(self._keys(rep), self.ptrs, self.sizes)
        if codes != self.sizes:
            raise RuntimeError(f"raw Mooncake get: {sorted(set(codes))}")

    def clear(self, rep: int) -> None:
        self.store.batch_remove(self.keys.pop(rep, []), True)

    def close(self) -> None:
        self.store.close()


class RawMooncakeRanged(RawMooncake):
    """The same pages through the bare client's session API, the calls the ``mooncake`` backend
    makes: ``batch_put_session_start`` + one ``batch_put_from_multi_buffer_ranges`` +
    ``batch_put_session_end``, and ``batch_get_session_start`` + one
    ``batch_get_into_multi_buffer_ranges`` + ``batch_get_session_end`` (Mooncake moves a ranged
    batch as one scatter transfer). No trailer, size query or check: what this API costs, so the
    ``mooncake`` row also reads as ours / (bare calls of the same kind)."""

    def set(self, rep: int) -> None:
        keys = self._keys(rep)
        started = self.store.batch_put_session_start(keys, self.sizes)
        codes = self.store.batch_put_from_multi_buffer_ranges(keys, [[p] for p in self.ptrs],
                                                              [[n] for n in self.sizes], [[0]] * len(keys))
        ended = self.store.batch_put_session_end(keys)
        if any(started) or codes != self.sizes or any(ended):
            raise RuntimeError(f"raw ranged Mooncake put: {sorted(set(started + codes + ended))}")

    def get(self, rep: int) -> None:
        keys = self._keys(rep)
        started = self.store.batch_get_session_start(keys)
        try:
            codes = self.store.batch_get_into_multi_buffer_ranges(keys, [[p] for p in self.ptrs],
                                                                  [[n] for n in self.sizes], [[0]] * len(keys))
        finally:
            self.store.batch_get_session_end(keys)
        if any(started) or codes != self.sizes:
            raise RuntimeError(f"raw ranged Mooncake get: {sorted(set(started + codes))}")


class MooncakeHolder:
    """A ``mooncake_master`` on 127.0.0.1 and one client holding the store's only segment."""

    def __init__(self, segment_bytes: int):
        from mooncake.store import MooncakeDistributedStore

        from sglang.test.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster().start()
        self.client = MooncakeDistributedStore()
        code = self.client.setup("127.0.0.1", self.master.metadata_server, segment_bytes, 16 << 20, "tcp", "",
                                 self.master.master_server_address)
        if code != 0:
            self.master.close()
            raise RuntimeError(f"Mooncake segment holder: setup failed ({code})")

    def close(self) -> None:
        self.client.close()
        self.master.close()


class Backend:
    def __init__(self, store, num_pages: int, label: str):
        self.store, self.label = store, label
        self.idx = torch.arange(num_pages * PAGE_TOKENS)
        self.keys = {}

    def prepare(self, rep: int) -> None:
        self._keys(rep)

    def _keys(self, rep: int) -> list[str]:
        if rep not in self.keys:  # new keys every repetition, as in serving
            tokens = list(range(len(self.idx)))
            self.keys[rep] = page_hashes(tokens, PAGE_TOKENS, namespace_hash(f"{self.label}-{rep}"))
        return self.keys[rep]

    def set(self, rep: int) -> None:
        ok = self.store.batch_set_v1(self._keys(rep), self.idx)
        if not all(ok):
            raise RuntimeError(f"{self.label}: set ok {sum(ok)} of {len(ok)}")

    def get(self, rep: int) -> None:
        ok = self.store.batch_get_v1(self._keys(rep), self.idx)
        if not all(ok):
            raise RuntimeError(f"{self.label}: get ok {sum(ok)} of {len(ok)}")

    def clear(self, rep: int) -> None:
        if self.label != "nixl_obj":  # NIXL cannot list or delete objects; the bucket is a fresh one
            self.store.clear()


def timed(fn, rep: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of ``fn(rep)``."""
    os.sync()  # each timed pass starts with no dirty pages from the other one
    w0, c0 = time.perf_counter(), time.process_time()
    fn(rep)
    return time.perf_counter() - w0, time.process_time() - c0


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


def cases(args, root: str, endpoint: str | None, mooncake=None) -> list[tuple[str, str, dict, bool]]:
    """(label, factory name, extra config, O_DIRECT) of every backend to measure."""
    out = [
        ("file", "file", {"storage_dir": f"{root}/file"}, False),
        ("file_1thread", "file", {"storage_dir": f"{root}/file1", "io_threads": 1}, False),
        ("nixl_posix", "nixl", {"storage_dir": f"{root}/nixl", "use_direct_io": "false"}, False),
    ]
    if args.direct:
        out.append(("nixl_posix_direct", "nixl", {"storage_dir": f"{root}/nixl_d", "use_direct_io": "true"}, True))
    if endpoint:
        out.append(("nixl_obj", "nixl", obj_extra(endpoint), False))
    if mooncake is not None:  # no segment of its own: pages live in the holder's
        out.append(("mooncake", "mooncake", mooncake.master.extra_config(global_segment_size=0), False))
    return [case for case in out if not args.only or case[0] in args.only]


def run_case(args, sides: dict) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """(wall, CPU) seconds per side and op over the timed repetitions (after ``--warmup``). Every
    repetition runs every side once, in an order rotated between repetitions, so each backend
    and the one baseline share the machine's state over the same stretch of time."""
    times = {side: {"set": [], "get": []} for side in sides}
    names = list(sides)
    for rep in range(args.warmup + args.repeat):
        shift = rep % len(names)
        order = names[shift:] + names[:shift]
        if rep % 2:
            order.reverse()
        for side in order:
            getattr(sides[side], "prepare", lambda rep: None)(rep)  # untimed: page keys come from the tree
            t_set, t_get = timed(sides[side].set, rep), timed(sides[side].get, rep)
            if rep >= args.warmup:
                times[side]["set"].append(t_set)
                times[side]["get"].append(t_get)
        for side in order:
            sides[side].clear(rep)
    return times


def record(label: str, op: str, page_bytes: int, total: int, ours: list, base: list, args, direct: bool) -> dict:
    """Median and best throughput of both sides. ``ratio`` (the headline) is the median over
    repetitions of the ratio within one repetition (robust to the load of a shared machine
    drifting between repetitions); ``ratio_best`` best over best; ``cpu_ratio`` the paired
    median on CPU seconds."""
    gbps = [total / wall / 1e9 for wall, _ in ours]
    plain = [total / wall / 1e9 for wall, _ in base]
    paired = [b[0] / o[0] for o, b in zip(ours, base)]
    cpu = [b[1] / o[1] for o, b in zip(ours, base) if o[1] > 0]
    return {
        "backend": label, "op": op, "page_bytes": page_bytes,
        "gbps_median": round(statistics.median(gbps), 3), "baseline_gbps_median": round(statistics.median(plain), 3),
        "ratio": round(statistics.median(paired), 3),
        "gbps": round(max(gbps), 3), "baseline_gbps": round(max(plain), 3), "ratio_best": round(max(gbps) / max(plain), 3),
        "cpu_ratio": round(statistics.median(cpu), 3) if cpu else None,
        "pages": args.pages, "repeat": args.repeat, "direct": direct,
    }


def measure(args, page_bytes: int, root: str, endpoint: str | None, mooncake=None) -> list[dict]:
    """Every backend and the baseline(s) of one page size, interleaved (see run_case)."""
    host = make_pool(page_bytes, args.pages)
    pages = [memoryview(host.get_data_page(i * PAGE_TOKENS, flat=False)[0].numpy()) for i in range(args.pages)]
    stores, sides, pairs = [], {}, []  # (row, the side it is compared with, O_DIRECT)
    try:
        for label, name, extra, direct in cases(args, root, endpoint, mooncake):
            cfg = HiCacheStorageConfig.from_cache_params(CacheInitParams(page_size=PAGE_TOKENS), host, "bench", extra)
            stores.append(StorageBackendFactory.create_backend(name, cfg, host))
            sides[label] = Backend(stores[-1], args.pages, label)
            base = "baseline_direct" if direct else "baseline"
            if base not in sides:
                sides[base] = Baseline(pages, f"{root}/{base}", direct)
            if label != "mooncake":
                pairs.append((label, base, direct))
        if args.raw_nixl and (not args.only or any(o.startswith("nixl") for o in args.only)):
            sides["nixl_raw"] = raw = RawNixl(pages, f"{root}/nixl_raw", False, host)
            stores.append(raw)
            pairs.append(("nixl_raw", "baseline", False))
            if native_io.HASH:
                sides["nixl_raw_hashed"] = hashed = RawNixlHashed(pages, f"{root}/nixl_raw_h", False, host)
                stores.append(hashed)
                pairs.append(("nixl_raw_hashed", "baseline", False))
        if "mooncake" in sides:
            sides["mooncake_raw"] = raw = RawMooncake(host, pages, mooncake.master)
            stores.append(raw)
            sides["mooncake_raw_ranged"] = ranged = RawMooncakeRanged(host, pages, mooncake.master)
            stores.append(ranged)
            pairs += [("mooncake", "mooncake_raw", False),  # ours / raw Mooncake (the headline)
                      ("mooncake", "mooncake_raw_ranged", False),  # ours / the same calls, bare
                      ("mooncake_raw", "baseline", False), ("mooncake_raw_ranged", "baseline", False)]
        times = run_case(args, sides)
    finally:
        for store in stores:
            store.close()
    return [record(label, op, page_bytes, page_bytes * args.pages, times[label][op], times[base][op], args, direct)
            | {"versus": base} for label, base, direct in pairs for op in ("set", "get")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (warm page cache)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    parser.add_argument("--obj", action="store_true", help="also NIXL OBJ against a local moto S3 server")
    parser.add_argument("--direct", action="store_true", help="also NIXL POSIX with O_DIRECT")
    parser.add_argument("--no-raw-nixl", dest="raw_nixl", action="store_false",
                        help="skip the bare NIXL POSIX row (the same files moved by one NIXL transfer)")
    parser.add_argument("--mooncake", action="store_true",
                        help="also the Mooncake backend and a bare Mooncake client (a local mooncake_master)")
    parser.add_argument("--only", nargs="+", default=None, metavar="ROW",
                        help="only these backend rows (file, file_1thread, nixl_posix, nixl_posix_direct, nixl_obj, "
                             "mooncake), with the baseline rows they are compared with")
    parser.add_argument("--json", default=None, help="write the records to this file as a JSON list")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_storage_", dir="/tmp")
    moto, endpoint = start_moto() if args.obj else (None, None)
    # room for one repetition of the three Mooncake sides (their pages are cleared after it), with slack
    mooncake = MooncakeHolder(4 * args.pages * max(args.page_kib) * 1024) if args.mooncake else None
    load_before = os.getloadavg()
    records = []
    try:
        for kib in args.page_kib:
            records += measure(args, kib * 1024, os.path.join(root, f"{kib}k"), endpoint, mooncake)
            shutil.rmtree(os.path.join(root, f"{kib}k"), ignore_errors=True)
    finally:
        if moto is not None:
            moto.terminate()
        if mooncake is not None:
            mooncake.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs")
    print("ratio: median over repetitions of baseline time / backend time (same bytes, same bucket tree, "
          "fresh files, no fsync on either side)")
    print(f"{'backend':<20} {'op':<4} {'page':>8} {'GB/s':>7} {'versus':>7} {'ratio':>6} | {'best':>7} {'versus':>7} "
          f"{'ratio':>6} {'cpu':>6}  versus")
    for r in records:
        cpu = f"{r['cpu_ratio']:>6.2f}" if r["cpu_ratio"] is not None else f"{'-':>6}"
        print(f"{r['backend']:<20} {r['op']:<4} {r['page_bytes'] // 1024:>6}Ki {r['gbps_median']:>7.2f} "
              f"{r['baseline_gbps_median']:>7.2f} {r['ratio']:>6.2f} | {r['gbps']:>7.2f} {r['baseline_gbps']:>7.2f} "
              f"{r['ratio_best']:>6.2f} {cpu}  {r['versus']}")
    for r in records:
        if r["backend"] == "mooncake":
            print(f"mooncake / {r['versus']} at {r['page_bytes'] // 1024} KiB pages, {r['op']}: {r['ratio']:.2f} "
                  f"(best over best {r['ratio_best']:.2f}, cpu {r['cpu_ratio']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
