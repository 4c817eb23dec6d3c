"""PD KV transfer throughput, one process per rank, beside raw transfers of the same bytes.

Every prefill and decode TP rank runs in its own spawned process (as in a real deployment) with
its own pools, the KV manager of ``--backend`` (nixl: NixlKVManager; mooncake: MooncakeKVManager)
and a raw engine of the same kind (a NIXL agent; a Mooncake TransferEngine on TCP); this process
only coordinates and hosts the bootstrap server. With mooncake a raw write is one synchronous
``batch_transfer_sync_write`` per pair (the pairs of a prefill rank in parallel), done when it
returns (Mooncake has no notifications). Per (prefill_tp, decode_tp, kv_heads) case and iteration (one warm-up first):

- ``pd``: every prefill rank sends the KV of a ``--tokens`` prompt from scattered source pages to
  scattered destination pages; timed from the first prefill rank's ``send`` until the last decode
  rank reports Success (all notifications in, staged bytes scattered), on one clock.
- ``raw`` (the baseline): every (prefill rank, decode rank) pair that exchanges KV moves the same
  byte count as ONE descriptor between the same processes, all pairs at once, timed the same way.
- ``single``: all the case's bytes as one descriptor between one prefill and one decode process
  (the figure a single-descriptor copy reaches with one sending core).
- ``raw_pages``: the ``raw`` pairs again, each pair's bytes as one descriptor per (page,
  registered buffer: layer and K or V, or the sidecar's) in shuffled order, the descriptors the
  pages route posts for scattered pages: NIXL's own cost of scattered pages
  (``raw_pages_vs_raw``), so that ``ratio`` splits into NIXL's part and ours
  (``ratio_raw_pages`` = pd / raw_pages).

``--state-layers N`` adds a Qwen3-Next-shaped Mamba state pool to every rank (N linear-attention
layers; per layer a conv state of the q|k|v channels of 16 key / 32 value heads of 128, kernel 4,
bf16, and a temporal state of 32 x 128 x 128 fp32 values, both sharded by heads): ``pd`` then
moves the request's state slot after its KV (cut and joined per q/k/v segment under
heterogeneous TP), and every baseline moves the same bytes, state included (``state_bytes``).

``--sidecar-layers N`` makes every rank DeepSeek-V3.2-shaped instead: the KV pool becomes MLA
latents (512 + 64 rope values, bf16, ``--layers`` layers, replicated across TP, so ``kv_heads``
is ignored) with a DSA indexer sidecar of N layers on the same pages (a 128-value bf16 key and
an fp32 scale per token); ``pd`` moves whole pages, latents and indexer keys in the same WRITEs,
from the first prefill target of every decode rank, and every baseline moves the same bytes,
sidecar included (``sidecar_bytes``).

``--layout allocator`` replaces the random permutation of pages (the worst case: every page its
own descriptor) with the pages a ``PagedAllocator`` hands a new request on a busy server (long
runs: its free list is sorted); ``page runs`` in the output counts the runs consecutive on both
sides. Pages are chosen before the timed region in both layouts.

The four run interleaved, iteration by iteration, so load changes hit them alike. Decode ranks
poll every millisecond in all three; prefill ranks poll flat out. Prints GB/s and ratios;
``--json FILE`` writes one record per case (``ratio`` = pd / raw; ``ratio_single`` = pd / single).

    python scripts/bench/bench_pd_transfer.py [--backend mooncake] [--tokens 4096] [--layers 8] [--iters 5]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang.srt.disaggregation.base import DisaggregationMode, KVArgs, KVPoll, TransferConfig  # noqa: E402
from sglang.srt.disaggregation.common.pool_plan import kv_args_of_pools  # noqa: E402
from sglang.srt.disaggregation.common.rank_mapping import head_slice, plan_decode_rank, state_row_slices  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool.dsa import DSAIndexerPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool.mamba import MambaPool  # noqa: E402

DEFAULT_CASES = "1x1x8,2x2x8,4x4x8,2x1x8,1x2x8,4x2x8,4x2x2"  # prefill_tp x decode_tp x kv_heads
HEAD_DIM, ELEM = 128, 2  # bf16
TERMINAL = (KVPoll.Success, KVPoll.Failed)
# Qwen3-Next-80B's linear attention: key heads, value heads, head dims, conv kernel
STATE_NK, STATE_NV, STATE_DK, STATE_DV, STATE_KERNEL = 16, 32, 128, 128, 4
STATE_SLOT = 1  # the request's state slot on every rank
# DeepSeek-V3.2: MLA latent (kv_lora_rank + rope), DSA indexer key dim (bf16) and its fp32 scale
MLA_LORA, MLA_ROPE, INDEX_DIM, INDEX_SCALE_BYTES = 512, 64, 128, 4


def sidecar_pools(args, size: int, page_size: int) -> tuple:
    """A DeepSeek-V3.2-shaped rank's paged pools for ``--sidecar-layers``: (MLA anchor, [indexer])."""
    anchor = MLATokenToKVPool(size, page_size, torch.bfloat16, MLA_LORA, MLA_ROPE, args.layers)
    return anchor, [DSAIndexerPool(size, page_size, INDEX_DIM, args.sidecar_layers, torch.bfloat16)]


def token_bytes(args, heads_sent: int) -> int:
    """Paged bytes of one token a sender moves: MHA K and V of ``heads_sent`` heads per layer, or
    with ``--sidecar-layers`` the MLA latent per layer plus the indexer key and scale per sidecar layer."""
    if args.sidecar_layers:
        return args.layers * (MLA_LORA + MLA_ROPE) * ELEM + sidecar_token_bytes(args)
    return args.layers * 2 * heads_sent * HEAD_DIM * ELEM


def sidecar_token_bytes(args) -> int:
    """Indexer bytes of one token: a key and its scale per sidecar layer (0 without)."""
    return args.sidecar_layers * (INDEX_DIM * ELEM + INDEX_SCALE_BYTES)


def paged_buffers(args) -> int:
    """Registered paged buffers of a rank: one descriptor each per page on the pages route."""
    return args.layers + 2 * args.sidecar_layers if args.sidecar_layers else args.layers * 2


def state_pool(args, tp_size: int) -> MambaPool | None:
    """A rank's Mamba state pool (two slots) for ``--state-layers``, None without."""
    if not args.state_layers:
        return None
    nk, nv = STATE_NK // tp_size, STATE_NV // tp_size
    return MambaPool(2, [(2 * nk * STATE_DK + nv * STATE_DV, STATE_KERNEL - 1)], (nv, STATE_DK, STATE_DV),
                     args.state_layers, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32,
                     conv_state_segments=[(nk * STATE_DK, nk * STATE_DK, nv * STATE_DV)])


def state_pair_bytes(args, tp: int, p: int, td: int, d: int) -> int:
    """State bytes prefill rank p sends decode rank d (the row runs of every state buffer)."""
    if not args.state_layers:
        return 0
    src, dst = state_pool(args, tp), state_pool(args, td)
    total = 0
    for comp in src.components:
        row_bytes = comp.item_bytes // comp.item_shape[0]
        seg_src, seg_dst = src.row_segments[comp.name], dst.row_segments[comp.name]
        rows = sum(run.num_rows for run in state_row_slices(seg_src, seg_dst, tp, p, td, d))
        total += rows * row_bytes * args.state_layers
    return total


def pair_bytes(args, tp: int, td: int, heads: int) -> dict[tuple[int, int], int]:
    """KV (and state) bytes prefill rank p sends decode rank d, for every pair that exchanges any."""
    out = {}
    for d in range(td):
        mla, has_state = bool(args.sidecar_layers), bool(args.state_layers)  # replicated pages / a state slot
        for plan in plan_decode_rank(heads, tp, td, d, is_mla=mla, has_state=has_state):
            n = state_pair_bytes(args, tp, plan.prefill_rank, td, d) if plan.send_state else 0
            if plan.send_kv:
                sent = 0 if args.sidecar_layers else head_slice(heads, tp, plan.prefill_rank, td, d).num_heads
                n += args.tokens * token_bytes(args, sent)
            if n:
                out[(plan.prefill_rank, d)] = n
    return out


def pool_pages(args) -> int:
    """Pages of each rank's pool: room to scatter the request's pages; with ``--layout
    allocator`` also for the other requests of a busy server."""
    n = args.tokens // args.page_size
    return n * 3 if args.layout == "allocator" else n * 5 // 4


def room_id(tp: int, td: int, heads: int, it: int) -> int:
    return 1000 * tp + 100 * td + 10 * heads + it


def page_seed(room: int, role: str, rank: int) -> int:
    """Seed of the pages a rank picks for ``room`` (prefill and decode ranks differ)."""
    return room * 10 + rank + (1 if role == "decode" else 0)


def make_rank(args, mode, tp_size: int, tp_rank: int, heads: int, addr: str | None):
    from sglang.srt.disaggregation.utils import get_kv_class

    num_pages = pool_pages(args)
    if args.sidecar_layers:
        pool, sidecars = sidecar_pools(args, num_pages * args.page_size, args.page_size)
    else:
        pool, sidecars = MHATokenToKVPool(num_pages * args.page_size, args.page_size, torch.bfloat16,
                                          max(1, heads // tp_size), HEAD_DIM, args.layers), []
    # touch every page now, not inside the timed transfer
    for buf in (b for p in (pool, *sidecars) for b in p.buffers.values()):
        if mode is DisaggregationMode.PREFILL:
            buf.view(torch.int16).random_(-30000, 30000)
        else:
            buf.view(torch.int16).fill_(1)
    state = state_pool(args, tp_size)
    for buf in (state.buffers.values() if state is not None else ()):
        buf.view(torch.int16).random_(-30000, 30000) if mode is DisaggregationMode.PREFILL else buf.zero_()
    kv_args = kv_args_of_pools(pool, sidecars, state, engine_rank=tp_rank, tp_rank=tp_rank, tp_size=tp_size,
                               total_kv_head_num=heads)
    extra = {} if args.descriptor_cost_kib is None else {"descriptor_cost_bytes": args.descriptor_cost_kib << 10}
    if args.pack_chunk_mib:
        extra["pack_chunk_bytes"] = args.pack_chunk_mib << 20
    cfg = TransferConfig(bootstrap_addr=addr, transfer_timeout_s=600, bootstrap_timeout_s=120,
                         staging_bytes=args.staging_mib << 20, **extra)
    mgr = get_kv_class(args.backend, "manager")(kv_args, mode, cfg)
    mgr.bench_state_pool, mgr.bench_sidecars = state, sidecars  # registered memory: must outlive the manager
    return mgr, pool


def scattered_pages(pool, n: int, seed: int) -> list[int]:
    return (np.random.default_rng(seed).permutation(pool.size // pool.page_size) + 1)[:n].tolist()


def allocator_pages(pool, n: int, seed: int) -> list[int]:
    """The pages the server's allocator (``PagedAllocator``, page 0 reserved as in the pools)
    hands a new request of ``n`` pages on a busy server: requests of 1 to n/8 pages come and go
    in random order until the pool has turned over several times, a third of it stays held by
    others, then this request allocates."""
    from sglang.srt.mem_cache.allocator import PagedAllocator

    rng = np.random.default_rng(seed)
    total = pool.size // pool.page_size
    alloc, live = PagedAllocator(total, 1, reserved_pages=1), []
    for _ in range(400):
        size = int(rng.integers(1, max(2, n // 8)))
        if live and (rng.random() < 0.5 or alloc.available_size() < size):
            alloc.free(live.pop(int(rng.integers(len(live)))))
        else:
            live.append(alloc.alloc_pages(size))
    while live and (total - alloc.available_size() > total // 3 or alloc.available_size() < n):
        alloc.free(live.pop(int(rng.integers(len(live)))))
    return alloc.alloc_pages(n).tolist()


def request_pages(args, pool, n: int, seed: int) -> list[int]:
    return (allocator_pages if args.layout == "allocator" else scattered_pages)(pool, n, seed)


def poll_until(objs, states, nap_s: float, deadline_s: float = 600) -> list[KVPoll]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = [o.poll() for o in objs]
        if all(s in states or s is KVPoll.Failed for s in got):
            return got
        if nap_s:
            time.sleep(nap_s)
    raise TimeoutError(f"not all reached {states}")


class Worker:
    """One rank's process: a raw engine (NIXL agent or Mooncake TransferEngine) for the baselines
    and, per case, a PD rank."""

    def __init__(self, conn, role: str, rank: int, args):
        self.conn, self.role, self.rank, self.args = conn, role, rank, args
        torch.set_num_threads(args.torch_threads)  # rank processes share the cores, as a deployment sizes them
        self.buf = torch.ones(args.max_bytes, dtype=torch.uint8)  # touched, like the pools
        if role == "prefill":
            self.buf.random_(0, 255)
        if args.backend == "mooncake":
            from mooncake.engine import TransferEngine

            self.raw = TransferEngine()
            assert self.raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            assert self.raw.register_memory(self.buf.data_ptr(), self.buf.numel()) == 0
            self.meta = f"127.0.0.1:{self.raw.get_rpc_port()}".encode()
            self.sessions: dict[str, str] = {}
        else:
            from nixl._api import nixl_agent, nixl_agent_config

            self.raw = nixl_agent(f"raw-{role}-{rank}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            self.raw.register_memory(self.buf)
            self.meta = self.raw.get_agent_metadata()
        self.mgr = self.pool = None

    def serve(self) -> None:
        self.conn.send((self.meta, self.buf.data_ptr()))
        while True:
            cmd, *rest = self.conn.recv()
            if cmd == "quit":
                if self.mgr is not None:
                    self.mgr.close()
                return
            self.conn.send(getattr(self, cmd)(*rest))

    def peers(self, metas: list[bytes]) -> None:
        for d, meta in enumerate(metas):
            if self.args.backend == "mooncake":
                self.sessions[f"raw-decode-{d}"] = meta.decode()
            else:
                self.raw.add_remote_agent(meta)

    def case(self, tp: int, heads: int, addr: str):
        mode = DisaggregationMode(self.role)
        self.mgr, self.pool = make_rank(self.args, mode, tp, self.rank, heads,
                                        addr if mode is DisaggregationMode.PREFILL else None)
        return "ok"

    def end_case(self):
        routes = {r.value: n for r, n in self.mgr.route_counts.items()}
        self.mgr.close()
        self.mgr = self.pool = None
        return routes

    def pd(self, room: int, addr: str):
        """Decode: receive the room (poll every ms) -> t_done. Prefill: wait for go -> t_start."""
        from sglang.srt.disaggregation.utils import get_kv_class

        NixlKVReceiver, NixlKVSender = (get_kv_class(self.args.backend, k) for k in ("receiver", "sender"))
        n_pages = self.args.tokens // self.args.page_size
        if self.role == "decode":
            recv = NixlKVReceiver(self.mgr, addr, room)
            poll_until([recv], (KVPoll.WaitingForInput,), 0.001)
            recv.init(request_pages(self.args, self.pool, n_pages, page_seed(room, "decode", self.rank)),
                      state_indices=[STATE_SLOT] if self.args.state_layers else None)
            self.conn.send("ready")
            state = poll_until([recv], TERMINAL, 0.001)[0]
            return int(state), time.monotonic()
        sender = NixlKVSender(self.mgr, addr, room)
        sender.init(n_pages)
        poll_until([sender], (KVPoll.WaitingForInput,), 0.001)
        self.conn.send("ready")
        pages = request_pages(self.args, self.pool, n_pages, page_seed(room, "prefill", self.rank))  # untimed
        assert self.conn.recv() == ("go",)
        t0 = time.monotonic()
        sender.send(pages, [STATE_SLOT] if self.args.state_layers else None)
        state = poll_until([sender], TERMINAL, 0.0)[0]
        return int(state), t0

    def raw_xfer(self, tag: str, writes: list[tuple[str, int, int, int, int]], expect: int):
        """Prefill: on go, post one WRITE per (remote, src_off, dst_ptr, nbytes, descriptors) -> t_start.
        Decode: wait (polling every ms) for ``expect`` notifications tagged ``tag`` -> t_done.
        Mooncake: prefill returns (state, t_start, t_done) itself, decode (state, 0.0) at once."""
        if self.args.backend == "mooncake":
            return self._raw_mooncake(writes)
        if self.role == "decode":
            self.conn.send("ready")
            got, deadline = 0, time.monotonic() + 600
            while True:  # same cadence as poll_until: check, then nap only if not done
                got += sum(m.decode().startswith(tag) for v in self.raw.get_new_notifs().values() for m in v)
                if got >= expect or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            return int(KVPoll.Success if got >= expect else KVPoll.Failed), time.monotonic()
        descs = [(self.raw.get_xfer_descs(_scattered(self.buf.data_ptr() + s, n, k, 1), "DRAM"),
                  self.raw.get_xfer_descs(_scattered(d, n, k, 2), "DRAM"), remote) for remote, s, d, n, k in writes]
        self.conn.send("ready")
        assert self.conn.recv() == ("go",)
        t0 = time.monotonic()
        handles = [self.raw.initialize_xfer("WRITE", s, d, remote, tag.encode()) for s, d, remote in descs]
        states = [self.raw.transfer(h) for h in handles]
        for i, h in enumerate(handles):
            while states[i] == "PROC":
                states[i] = self.raw.check_xfer_state(h)
            self.raw.release_xfer_handle(h)
        return int(KVPoll.Success if all(s == "DONE" for s in states) else KVPoll.Failed), t0


    def _mooncake_write(self, job, batch: int = 1024) -> int:
        """One pair's write in batches of at most ``batch`` ranges (as MooncakeTransport posts)."""
        session, src, dst, lens = job
        codes = [self.raw.batch_transfer_sync_write(session, src[i:i + batch], dst[i:i + batch], lens[i:i + batch])
                 for i in range(0, len(src), batch)]
        return min(codes)

    def _raw_mooncake(self, writes: list[tuple[str, int, int, int, int]]):
        from concurrent.futures import ThreadPoolExecutor

        if self.role == "decode":
            self.conn.send("ready")
            return int(KVPoll.Success), 0.0
        jobs = []
        for remote, s, d, n, k in writes:
            src, dst = _scattered(self.buf.data_ptr() + s, n, k, 1), _scattered(d, n, k, 2)
            jobs.append((self.sessions[remote], src[:, 0].tolist(), dst[:, 0].tolist(), src[:, 1].tolist()))
        self.conn.send("ready")
        assert self.conn.recv() == ("go",)
        with ThreadPoolExecutor(max(1, len(jobs))) as pool:
            t0 = time.monotonic()
            codes = list(pool.map(self._mooncake_write, jobs))
            t1 = time.monotonic()
        return int(KVPoll.Success if all(c >= 0 for c in codes) else KVPoll.Failed), t0, t1


def _scattered(base: int, nbytes: int, pieces: int, seed: int) -> np.ndarray:
    """(ptr, len, 0) rows covering [base, base + nbytes): one row, or ``pieces`` equal pieces in
    a shuffled order (no two consecutive rows adjacent in memory, as scattered pages are)."""
    if pieces <= 1:
        return np.array([[base, nbytes, 0]], dtype=np.uint64)
    size = nbytes // pieces
    order = np.random.default_rng(seed).permutation(pieces).astype(np.uint64)
    return np.stack([base + order * np.uint64(size), np.full(pieces, size, dtype=np.uint64),
                     np.zeros(pieces, dtype=np.uint64)], axis=1)


def worker_main(conn, role: str, rank: int, args) -> None:
    Worker(conn, role, rank, args).serve()


class Coordinator:
    def __init__(self, args, max_tp: int, max_td: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.info = {}, [], {}
        for role, n in (("prefill", max_tp), ("decode", max_td)):
            for r in range(n):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(theirs, role, r, args), daemon=True)
                proc.start()
                self.conns[(role, r)], self.procs = mine, self.procs + [proc]
        for key, conn in self.conns.items():
            self.info[key] = conn.recv()  # (raw agent metadata, raw buffer pointer)
        metas = [meta for (role, _), (meta, _) in self.info.items() if role == "decode"]
        self.call({k: ("peers", metas) for k in self.conns if k[0] == "prefill"})

    def call(self, cmds: dict) -> dict:
        for key, cmd in cmds.items():
            self.conns[key].send(cmd)
        return {key: self.conns[key].recv() for key in cmds}

    def timed(self, cmds: dict) -> float:
        """Run a transfer on every worker in ``cmds``: all report ready, prefill gets go; seconds
        from the first prefill start to the last decode finish."""
        self.call_ready(cmds)
        for key in cmds:
            if key[0] == "prefill":
                self.conns[key].send(("go",))
        results = {key: self.conns[key].recv() for key in cmds}
        if any(res[0] != KVPoll.Success for res in results.values()):
            raise RuntimeError(f"transfer failed: {results}")
        # decode reports (state, t_done); prefill (state, t_start), or (state, t_start, t_done) when
        # it knows the end itself (a synchronous Mooncake write)
        ends = [res[-1] for (role, _), res in results.items() if role == "decode" or len(res) == 3]
        return max(ends) - min(res[1] for (role, _), res in results.items() if role == "prefill")

    def call_ready(self, cmds: dict) -> None:
        for key, cmd in cmds.items():
            self.conns[key].send(cmd)
        for key in cmds:
            assert self.conns[key].recv() == "ready"

    def raw_cmds(self, tag: str, pairs: dict[tuple[int, int], int], pieces: int = 1) -> dict:
        """One WRITE per pair; each prefill's sources and each decode's destinations packed
        (``pieces`` > 1: each pair's bytes as that many scattered descriptors)."""
        writes, expect, src_off, dst_off = {}, Counter(), Counter(), Counter()
        for (p, d), n in sorted(pairs.items()):
            remote = f"raw-decode-{d}"
            writes.setdefault(p, []).append((remote, src_off[p], self.info[("decode", d)][1] + dst_off[d], n, pieces))
            src_off[p] += n
            dst_off[d] += n
            expect[d] += 1
        cmds = {("decode", d): ("raw_xfer", tag, [], k) for d, k in expect.items()}
        cmds.update({("prefill", p): ("raw_xfer", tag, w, 0) for p, w in writes.items()})
        return cmds

    def close(self) -> None:
        for conn in self.conns.values():
            conn.send(("quit",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def page_run_stats(args, tp: int, td: int, heads: int) -> float:
    """Median over the timed iterations of the runs of pages consecutive on both sides between
    prefill rank 0 and decode rank 0 (the pages route posts one descriptor per run, layer and K
    or V): the pages the workers picked, recomputed from the same seeds."""
    from sglang.srt.disaggregation.common.descriptors import page_runs

    n = args.tokens // args.page_size

    class Pool:  # what request_pages reads of a rank's pool
        page_size = args.page_size
        size = pool_pages(args) * args.page_size

    counts = []
    for it in range(1, args.iters + 1):
        room = room_id(tp, td, heads, it)
        src = np.array(request_pages(args, Pool, n, page_seed(room, "prefill", 0)))
        dst = np.array(request_pages(args, Pool, n, page_seed(room, "decode", 0)))
        counts.append(len(page_runs(src, dst)[0]))
    return statistics.median(counts)


def run_case(co: Coordinator, args, tp: int, td: int, heads: int) -> dict:
    from sglang.srt.disaggregation.utils import get_kv_class

    server = get_kv_class(args.backend, "bootstrap_server")()
    load = [os.getloadavg()[0]]
    pairs = pair_bytes(args, tp, td, heads)
    total = sum(pairs.values())
    prefill, decode = [("prefill", r) for r in range(tp)], [("decode", r) for r in range(td)]
    co.call({k: ("case", tp, heads, server.addr) for k in prefill})
    co.call({k: ("case", td, heads, server.addr) for k in decode})
    times = {"pd": [], "raw": [], "single": [], "raw_pages": []}
    descriptors = args.tokens // args.page_size * paged_buffers(args)  # one per (page, registered buffer)
    for it in range(args.iters + 1):
        room = room_id(tp, td, heads, it)
        runs = {"pd": {k: ("pd", room, server.addr) for k in decode + prefill},
                "raw": co.raw_cmds(f"raw-{room}|", pairs),
                "single": co.raw_cmds(f"single-{room}|", {(0, 0): total}),
                "raw_pages": co.raw_cmds(f"pages-{room}|", pairs, descriptors)}
        for name, cmds in runs.items():
            elapsed = co.timed(cmds)
            if it:
                times[name].append(elapsed)
    runs = page_run_stats(args, tp, td, heads)
    routes = co.call({k: ("end_case",) for k in prefill})
    co.call({k: ("end_case",) for k in decode})
    server.close()
    load.append(os.getloadavg()[0])
    gbps = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    return {"prefill_tp": tp, "decode_tp": td, "kv_heads": heads, "bytes": total, "gbps": round(gbps["pd"], 3),
            "baseline_gbps": round(gbps["raw"], 3), "ratio": round(gbps["pd"] / gbps["raw"], 3),
            "single_gbps": round(gbps["single"], 3), "ratio_single": round(gbps["pd"] / gbps["single"], 3),
            "raw_pages_gbps": round(gbps["raw_pages"], 3), "ratio_raw_pages": round(gbps["pd"] / gbps["raw_pages"], 3),
            "raw_pages_vs_raw": round(gbps["raw_pages"] / gbps["raw"], 3), "descriptors_per_pair": descriptors,
            "pd_ms": [round(t * 1e3, 2) for t in times["pd"]], "raw_ms": [round(t * 1e3, 2) for t in times["raw"]],
            "routes": dict(sum((Counter(r) for r in routes.values()), Counter())), "load": load,
            "layout": args.layout, "page_runs_median": runs, "backend": args.backend,
            "state_bytes": sum(state_pair_bytes(args, tp, p, td, d) for p, d in pairs),
            "sidecar_bytes": len(pairs) * args.tokens * sidecar_token_bytes(args)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nixl", "mooncake"), default="nixl",
                    help="PD transfer backend, and the raw engine of the baselines")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (tokens)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per case (after one warm-up)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of PREFILLTPxDECODETPxKVHEADS")
    ap.add_argument("--staging-mib", type=int, default=256, help="TransferConfig.staging_bytes per rank in MiB")
    ap.add_argument("--descriptor-cost-kib", type=int, default=None,
                    help="TransferConfig.descriptor_cost_bytes in KiB (default: the dataclass default)")
    ap.add_argument("--pack-chunk-mib", type=int, default=0,
                    help="TransferConfig.pack_chunk_bytes in MiB (default: the dataclass default)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads per rank process (default: cores / rank processes, at least 1)")
    ap.add_argument("--layout", choices=("scattered", "allocator"), default="scattered",
                    help="source and destination pages: a random permutation (the worst case: no two "
                         "adjacent), or what the allocator hands a new request on a busy server")
    ap.add_argument("--state-layers", type=int, default=0,
                    help="add a Qwen3-Next-shaped Mamba state pool of this many layers (0: KV only)")
    ap.add_argument("--sidecar-layers", type=int, default=0,
                    help="DeepSeek-V3.2-shaped ranks: MLA latents of --layers layers plus a DSA indexer "
                         "sidecar of this many layers on the same pages (0: MHA KV)")
    ap.add_argument("--json", help="write one JSON record per case to this file")
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.sidecar_layers and args.state_layers:
        ap.error("--sidecar-layers (DeepSeek-V3.2 shape) and --state-layers (Qwen3-Next shape) exclude each other")
    if args.tokens % args.page_size:
        ap.error(f"--tokens {args.tokens} must be a multiple of --page-size {args.page_size}")
    args.max_bytes = max(sum(pair_bytes(args, tp, td, h).values()) for tp, td, h in cases)
    workers = max(c[0] for c in cases) + max(c[1] for c in cases)
    args.torch_threads = args.torch_threads or max(1, (os.cpu_count() or 1) // workers)
    co = Coordinator(args, max(c[0] for c in cases), max(c[1] for c in cases))
    records = []
    try:
        for tp, td, heads in cases:
            rec = run_case(co, args, tp, td, heads)
            records.append(rec)
            state = f" (state {rec['state_bytes'] / 2**20:.1f} MiB)" if rec["state_bytes"] else ""
            state += f" (sidecar {rec['sidecar_bytes'] / 2**20:.1f} MiB)" if rec["sidecar_bytes"] else ""
            print(f"TP {tp}->{td} H={heads}: {rec['bytes'] / 2**20:6.1f} MiB{state}  pd {rec['gbps']:5.2f} GB/s  "
                  f"raw {rec['baseline_gbps']:5.2f}  ratio {rec['ratio']:.2f}  single {rec['single_gbps']:5.2f}  "
                  f"ratio_single {rec['ratio_single']:.2f}  raw_pages {rec['raw_pages_gbps']:5.2f} "
                  f"(raw x{rec['raw_pages_vs_raw']:.2f}, pd/raw_pages {rec['ratio_raw_pages']:.2f})  "
                  f"routes {rec['routes']}  page runs {rec['page_runs_median']:g}/{args.tokens // args.page_size}  "
                  f"load {rec['load']}", flush=True)
    finally:
        co.close()
    homo = {(r["prefill_tp"], r["kv_heads"]): r["gbps"] for r in records if r["prefill_tp"] == r["decode_tp"]}
    for r in records:  # heterogeneous vs homogeneous with the same prefill deployment (same TP, same heads)
        ref = homo.get((r["prefill_tp"], r["kv_heads"]))
        if r["prefill_tp"] != r["decode_tp"] and ref:
            r["vs_homogeneous"] = round(r["gbps"] / ref, 3)
            print(f"heterogeneous TP {r['prefill_tp']}->{r['decode_tp']} H={r['kv_heads']}: "
                  f"{r['vs_homogeneous']:.2f}x of homogeneous TP {r['prefill_tp']}->{r['prefill_tp']}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
