"""PD KV transfer throughput between two processes, beside a raw NIXL transfer of the same bytes.

This process plays prefill (all prefill TP ranks, one NixlKVManager each) and spawns one decode
process (all decode TP ranks). For each (prefill_tp, decode_tp, kv_heads) case it moves the KV
of a ``--tokens`` prompt from scattered source pages to scattered destination pages, ``--iters``
times after one warm-up, timing from the first ``send`` until the decode process reports every
receiver Success (all notifications in, staged slices scattered). In the same run, a raw NIXL
WRITE of the same byte count in ONE descriptor between the same two processes, timed until the
decode process has seen its notification, gives the baseline. Prints GB/s and ratios;
``--json FILE`` writes one record per case.

    python scripts/bench/bench_pd_transfer.py [--tokens 4096] [--layers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang.srt.disaggregation.base import DisaggregationMode, KVArgs, KVPoll, TransferConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

DEFAULT_CASES = "1x1x8,2x2x8,4x4x8,2x1x8,1x2x8,4x2x8,4x2x2"  # prefill_tp x decode_tp x kv_heads
HEAD_DIM = 128


def make_rank(args, mode, tp_size: int, tp_rank: int, heads: int, addr: str | None):
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    num_pages = args.tokens // args.page_size * 5 // 4  # room to scatter
    pool = MHATokenToKVPool(num_pages * args.page_size, args.page_size, torch.bfloat16, max(1, heads // tp_size),
                            HEAD_DIM, args.layers)
    for buf in pool.buffers.values():  # touch every page now, not inside the timed transfer
        if mode is DisaggregationMode.PREFILL:
            buf.view(torch.int16).random_(-30000, 30000)
        else:
            buf.view(torch.int16).fill_(1)
    kv_args = KVArgs.from_pools(pool, engine_rank=tp_rank, tp_rank=tp_rank, tp_size=tp_size,
                                total_kv_head_num=heads)
    cfg = TransferConfig(bootstrap_addr=addr, transfer_timeout_s=600, bootstrap_timeout_s=120,
                         staging_bytes=args.staging_mib << 20)
    return NixlKVManager(kv_args, mode, cfg), pool


def scattered_pages(pool, n: int, seed: int) -> list[int]:
    return (np.random.default_rng(seed).permutation(pool.size // pool.page_size) + 1)[:n].tolist()


def poll_all(objs, nap_s: float = 0.0, deadline_s: float = 600) -> list[KVPoll]:
    """Poll until every object is terminal. Prefill polls flat out (polling drives its WRITEs);
    decode naps so that it does not take a core from the sender."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        states = [o.poll() for o in objs]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states):
            return states
        if nap_s:
            time.sleep(nap_s)
    raise TimeoutError("transfer did not finish")


def decode_main(conn, args) -> None:
    """Decode process: serves commands from the prefill process over ``conn``."""
    from nixl._api import nixl_agent, nixl_agent_config

    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    raw = nixl_agent("bench-raw-decode", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    raw_buf = torch.ones(conn.recv(), dtype=torch.uint8)  # touched, like the pools
    raw.register_memory(raw_buf)
    conn.send((raw.get_agent_metadata(), raw_buf.data_ptr()))
    ranks = []
    while True:
        cmd, *rest = conn.recv()
        if cmd == "case":
            tp, heads, addr = rest
            ranks = [make_rank(args, DisaggregationMode.DECODE, tp, r, heads, None) for r in range(tp)]
            conn.send(sum(args.tokens * sum(m.args.kv_item_lens) for m, _ in ranks))
        elif cmd == "room":
            room, addr = rest
            recvs = [NixlKVReceiver(m, addr, room) for m, _ in ranks]
            poll_all_until(recvs, KVPoll.WaitingForInput)
            for r, (_, pool) in zip(recvs, ranks):
                r.init(scattered_pages(pool, args.tokens // args.page_size, room + 1))
            conn.send("ready")
            conn.send(("done", [int(s) for s in poll_all(recvs, nap_s=0.001)]))
        elif cmd == "end_case":
            for m, _ in ranks:
                m.close()
            ranks = []
            conn.send("closed")
        elif cmd == "raw_wait":
            while not raw.check_remote_xfer_done(rest[0], rest[1].encode()):
                time.sleep(0.001)  # same nap as the PD receivers
            conn.send("raw_done")
        else:
            return


def poll_all_until(objs, state: KVPoll, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while not all(o.poll() == state for o in objs):
        if time.monotonic() > deadline or any(o.poll() == KVPoll.Failed for o in objs):
            raise RuntimeError(f"not all reached {state.name}: {[o.poll().name for o in objs]}")
        time.sleep(0.001)


def run_case(conn, args, prefill_tp: int, decode_tp: int, heads: int) -> tuple[int, list[float]]:
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVSender

    server = NixlKVBootstrapServer()
    ranks = [make_rank(args, DisaggregationMode.PREFILL, prefill_tp, r, heads, server.addr) for r in range(prefill_tp)]
    conn.send(("case", decode_tp, heads, server.addr))
    nbytes = conn.recv()
    n_pages = args.tokens // args.page_size
    times = []
    for it in range(args.iters + 1):
        room = 1000 * prefill_tp + 100 * decode_tp + it
        senders = [NixlKVSender(m, server.addr, room) for m, _ in ranks]
        for s in senders:
            s.init(n_pages)
        conn.send(("room", room, server.addr))
        assert conn.recv() == "ready"
        poll_all_until(senders, KVPoll.WaitingForInput)
        t0 = time.perf_counter()
        for s, (_, pool) in zip(senders, ranks):
            s.send(scattered_pages(pool, n_pages, room))
        states = poll_all(senders)
        _, dstates = conn.recv()  # decode reports once every receiver is Success (staging scattered)
        elapsed = time.perf_counter() - t0
        if any(s != KVPoll.Success for s in states + dstates):
            raise RuntimeError(f"case {prefill_tp}->{decode_tp} failed: prefill {states}, decode {dstates}")
        if it:
            times.append(elapsed)
    conn.send(("end_case",))
    conn.recv()
    for m, _ in ranks:
        m.close()
    server.close()
    return nbytes, times


def raw_times(conn, raw, remote: str, src: torch.Tensor, dst_ptr: int, nbytes: int, iters: int) -> list[float]:
    """Seconds of a one-descriptor WRITE of ``nbytes`` until the decode process has seen its
    notification, timed like the PD cases (from posting until decode reports)."""
    times = []
    for it in range(iters + 1):
        tag = f"raw-{nbytes}-{it}"
        descs_src = raw.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
        descs_dst = raw.get_xfer_descs([(dst_ptr, nbytes, 0)], "DRAM")
        conn.send(("raw_wait", raw.name, tag))  # decode starts progressing (and waiting) now
        t0 = time.perf_counter()
        handle = raw.initialize_xfer("WRITE", descs_src, descs_dst, remote, tag.encode())
        state = raw.transfer(handle)
        while state == "PROC":
            state = raw.check_xfer_state(handle)
        assert conn.recv() == "raw_done"
        elapsed = time.perf_counter() - t0
        raw.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw transfer ended {state}")
        if it:
            times.append(elapsed)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (tokens)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per case (after one warm-up)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of PREFILLTPxDECODETPxKVHEADS")
    ap.add_argument("--staging-mib", type=int, default=256,
                    help="TransferConfig.staging_bytes per rank in MiB; 0 = per-token head slices")
    ap.add_argument("--json", help="write one JSON record per case to this file")
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.tokens % args.page_size:
        ap.error(f"--tokens {args.tokens} must be a multiple of --page-size {args.page_size}")

    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_main, args=(child_conn, args), daemon=True)
    child.start()
    max_bytes = args.tokens * args.layers * 2 * 8 * HEAD_DIM * 2 * 2  # generous: covers replication
    try:
        conn.send(max_bytes)
        meta, dst_ptr = conn.recv()
        raw = nixl_agent("bench-raw-prefill", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        src = torch.randint(0, 255, (max_bytes,), dtype=torch.uint8)
        raw.register_memory(src)
        remote = raw.add_remote_agent(meta)
        records = []
        for prefill_tp, decode_tp, heads in cases:
            nbytes, times = run_case(conn, args, prefill_tp, decode_tp, heads)
            base = raw_times(conn, raw, remote, src, dst_ptr, nbytes, args.iters)
            gbps = nbytes / statistics.median(times) / 1e9
            base_gbps = nbytes / statistics.median(base) / 1e9
            rec = {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "kv_heads": heads, "bytes": nbytes,
                   "gbps": round(gbps, 3), "baseline_gbps": round(base_gbps, 3), "ratio": round(gbps / base_gbps, 3)}
            records.append(rec)
            print(f"TP {prefill_tp}->{decode_tp} H={heads}: {nbytes / 2**20:8.1f} MiB  {gbps:7.2f} GB/s  "
                  f"raw {base_gbps:7.2f} GB/s  ratio {rec['ratio']:.2f}", flush=True)
        # heterogeneous vs homogeneous with the same prefill deployment (same TP, same heads)
        homo = {(r["prefill_tp"], r["kv_heads"]): r["gbps"] for r in records if r["prefill_tp"] == r["decode_tp"]}
        for r in records:
            ref = homo.get((r["prefill_tp"], r["kv_heads"]))
            if r["prefill_tp"] != r["decode_tp"] and ref:
                print(f"heterogeneous TP {r['prefill_tp']}->{r['decode_tp']} H={r['kv_heads']}: "
                      f"{r['gbps'] / ref:.2f}x of homogeneous TP {r['prefill_tp']}->{r['prefill_tp']}")
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=2))
    finally:
        conn.send(("quit",))
        child.join(10)
        if child.is_alive():
            child.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
