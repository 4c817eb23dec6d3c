"""Heterogeneous and homogeneous TP over real NIXL agents in one process (UCX loopback), through
every KV route: packed staging on both sides, runs of source pages into the decode's staging,
prefill-side gather into whole destination pages, whole pages, and per-token head slices (into
the pool, or into the decode's staging when prefill has none), including the fallbacks when
staging is full. Each decode rank must hold exactly the heads it owns (checked by
``pd_workers.check_decode``), and every staging byte must be free afterwards."""

import contextlib
import inspect
import time
from collections import Counter

import numpy as np
import pytest
import torch

from mp_harness import BASE_CFG
from pd_workers import build_rank, check_decode, fill_prefill
from sglang.srt.disaggregation.base import DisaggregationMode, KVPoll, TransferConfig
from sglang.srt.disaggregation.nixl.conn import (
    KVRoute,
    NixlKVBootstrapServer,
    NixlKVManager,
    NixlKVReceiver,
    NixlKVSender,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="nightly-cpu")

NO_STAGING = {"staging_bytes": 0}
DIRECT = {"descriptor_cost_bytes": 0}  # stage only what would otherwise go per token
TINY = {"staging_bytes": 64}  # too small for any piece: fallbacks
PIECES = {"pack_chunk_bytes": 200}  # several pieces (and notifications) per chunk


@contextlib.contextmanager
def cluster(prefill_tp: int, decode_tp: int, heads: int, prefill_conf=None, decode_conf=None, state_rows: int = 0):
    """Bootstrap server + one manager per rank (pools filled / sentinel-filled); closed on exit.
    ``*_conf``: TransferConfig overrides of each side."""
    cfg = dict(BASE_CFG, heads=heads, state_rows=state_rows)
    server = NixlKVBootstrapServer()
    conf = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, transfer_timeout_s=30.0)
    prefill, decode = [], []
    try:
        for r in range(prefill_tp):
            kv, state, aux, args = build_rank(cfg, "prefill", prefill_tp, r)
            fill_prefill(cfg, kv, state, aux, prefill_tp, r)
            tc = TransferConfig(bootstrap_addr=server.addr, **conf, **(prefill_conf or {}))
            prefill.append((NixlKVManager(args, DisaggregationMode.PREFILL, tc), (kv, state, aux)))
        for r in range(decode_tp):
            kv, state, aux, args = build_rank(cfg, "decode", decode_tp, r)
            for buf in kv.buffers.values():
                buf.fill_(-7)
            tc = TransferConfig(**conf, **(decode_conf or {}))
            decode.append((NixlKVManager(args, DisaggregationMode.DECODE, tc), (kv, state, aux)))
        yield cfg, server, prefill, decode
    finally:
        for m, _ in decode + prefill:
            m.close()
        server.close()


def assert_decode_staging_released(decode) -> None:
    """A failed room's decode staging is quarantined (a WRITE prefill posted may still land),
    then freed once the quarantine (heartbeat_timeout_s) is over; nothing leaks."""
    for m, _ in decode:
        assert m.staging.free_bytes() + m.staging_quarantined_bytes == m.staging.nbytes
        deadline = time.monotonic() + m.config.heartbeat_timeout_s + 5
        while m.staging_quarantined_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.staging.free_bytes() == m.staging.nbytes


def start(cfg, server, prefill, decode, room: int = 7):
    """Senders and receivers of one room, both sides past bootstrap, nothing sent yet."""
    senders = [NixlKVSender(m, server.addr, room) for m, _ in prefill]
    for s in senders:
        s.init(len(cfg["src_pages"]), aux_index=cfg["aux_src"])
    recvs = [NixlKVReceiver(m, server.addr, room) for m, _ in decode]
    wait_all(recvs, KVPoll.WaitingForInput)
    for r in recvs:
        r.init(cfg["dst_pages"], aux_index=cfg["aux_dst"],
               state_indices=[cfg["state_dst"]] if cfg["state_rows"] else None)
    wait_all(senders, KVPoll.WaitingForInput)
    return senders, recvs


def run(prefill_tp: int, decode_tp: int, heads: int, prefill_conf=None, decode_conf=None, state_rows: int = 0):
    """Move the request in two chunks; check every decode rank's bytes; return the WRITEs per route."""
    with cluster(prefill_tp, decode_tp, heads, prefill_conf, decode_conf, state_rows) as (cfg, server, prefill, decode):
        senders, recvs = start(cfg, server, prefill, decode)
        for lo, hi in ((0, 3), (3, 7)):
            for s in senders:
                s.send(cfg["src_pages"][lo:hi], [cfg["state_src"]] if hi == 7 and state_rows else None)
        wait_all(senders + recvs, KVPoll.Success)
        for r, (m, (kv, state, aux)) in enumerate(decode):
            assert check_decode(cfg, kv, state, aux, decode_tp, r, prefill_tp) == []
        for m, _ in prefill + decode:
            assert m.staging is None or m.staging.free_bytes() == m.staging.nbytes, "staging leaked"
            assert m.num_active_rooms() == 0
        return sum((m.route_counts for m, _ in prefill), Counter())


def wait_all(objs, state: KVPoll, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [o.poll() for o in objs]
        if all(s == state for s in states):
            return
        if KVPoll.Failed in states and state != KVPoll.Failed:
            failed = [str(o.failure_exception()) for o in objs if o.poll() == KVPoll.Failed]
            raise AssertionError(f"failed while waiting for {state.name}: {failed}")
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {state.name}: {[o.poll().name for o in objs]}")


@pytest.mark.parametrize("prefill_tp,decode_tp,heads,prefill_conf,decode_conf,state_rows,routes", [
    (2, 1, 4, None, None, 8, [KVRoute.PACKED]),
    (4, 1, 4, PIECES, None, 0, [KVRoute.PACKED]),
    (1, 2, 4, None, None, 8, [KVRoute.PACKED]),
    (1, 4, 2, PIECES, None, 0, [KVRoute.PACKED]),  # decode-side replication, H < Td
    (1, 1, 4, PIECES, None, 8, [KVRoute.PACKED]),  # short pages: staged even with equal TP
    (2, 4, 2, None, None, 0, [KVRoute.PACKED]),  # one head per rank on both sides
    (2, 1, 4, DIRECT, DIRECT, 0, [KVRoute.DECODE_STAGING]),
    (2, 1, 4, NO_STAGING, None, 0, [KVRoute.DECODE_STAGING]),
    (2, 1, 4, TINY, None, 0, [KVRoute.DECODE_STAGING]),  # no room to pack: falls back
    (1, 2, 4, None, DIRECT, 8, [KVRoute.GATHER]),
    (1, 4, 2, None, TINY, 0, [KVRoute.GATHER]),
    (1, 2, 4, NO_STAGING, None, 0, [KVRoute.TOKEN_SLICE]),  # per token, into the decode's staging
    (1, 2, 4, TINY, None, 0, [KVRoute.TOKEN_SLICE]),
    (2, 1, 4, NO_STAGING, NO_STAGING, 0, [KVRoute.TOKEN_SLICE]),
    (1, 4, 2, NO_STAGING, NO_STAGING, 0, [KVRoute.TOKEN_SLICE]),
    (2, 4, 2, DIRECT, DIRECT, 0, [KVRoute.PAGES]),
    (1, 1, 4, None, DIRECT, 0, [KVRoute.PAGES]),
])
def test_kv_routes(prefill_tp, decode_tp, heads, prefill_conf, decode_conf, state_rows, routes):
    assert sorted(run(prefill_tp, decode_tp, heads, prefill_conf, decode_conf, state_rows)) == routes


def test_pieces_are_one_write_and_notification_each():
    # 1 -> 1, 4 heads of 16 B: a page of 4 tokens x 4 buffers is 1 KiB, so 200-byte pieces hold one
    # page: 7 pages in two chunks -> 7 WRITEs, each scattered by decode on arrival
    assert run(1, 1, 4, PIECES) == Counter({KVRoute.PACKED: 7})
    assert run(2, 1, 4, dict(PIECES, staging_bytes=0)) == Counter({KVRoute.DECODE_STAGING: 14})


def test_decode_scatters_each_staged_chunk_as_it_lands():
    with cluster(2, 1, 4) as (cfg, server, prefill, decode):
        senders, recvs = start(cfg, server, prefill, decode)
        for s in senders:
            s.send(cfg["src_pages"][:3])  # first chunk only
        mgr, (kv, state, aux) = decode[0]
        deadline = time.monotonic() + 10
        while mgr.decode_rooms[7].status.num_received < 2 and time.monotonic() < deadline:
            recvs[0].poll()
            time.sleep(0.002)
        assert recvs[0].poll() == KVPoll.Transferring
        first = dict(cfg, dst_pages=cfg["dst_pages"][:3])  # tokens 0-11 in place, the rest untouched
        assert [e for e in check_decode(first, kv, state, aux, 1, 0, 2) if not e.startswith("aux")] == []
        for s in senders:
            s.send(cfg["src_pages"][3:])
        wait_all(senders + recvs, KVPoll.Success)
        assert check_decode(cfg, kv, state, aux, 1, 0, 2) == []


def test_kv_chunk_naming_pages_past_the_request_is_dropped(caplog):
    with cluster(1, 1, 4) as (cfg, server, prefill, decode):
        senders, recvs = start(cfg, server, prefill, decode)
        pmgr, dmgr = prefill[0][0], decode[0][0]
        pmgr.agent.send_notif(dmgr.agent_name, b"7|kv|0|0|1|5|100")  # from the real sender, bad range
        deadline = time.monotonic() + 10
        while "pages past the request's 7" not in caplog.text and time.monotonic() < deadline:
            recvs[0].poll()
            time.sleep(0.01)
        assert "pages past the request's 7" in caplog.text
        senders[0].send(cfg["src_pages"])  # the room still completes with the real chunks
        wait_all(senders + recvs, KVPoll.Success)
        assert check_decode(cfg, *decode[0][1], 1, 0, 1) == []


def test_staged_sender_whose_chunks_skip_pages_fails_the_room():
    # a sender that reports its last chunk without naming the pages it staged (old 5-field tag)
    # would leave garbage in the pool; decode fails the room instead of reporting Success
    with cluster(2, 1, 4) as (cfg, server, prefill, decode):
        senders, recvs = start(cfg, server, prefill, decode)
        name = decode[0][0].agent_name
        prefill[0][0].agent.send_notif(name, b"7|kv|0|0|1")
        prefill[0][0].agent.send_notif(name, b"7|aux|0|0|0")
        prefill[1][0].agent.send_notif(name, b"7|kv|1|0|1")
        wait_all(recvs, KVPoll.Failed)
        assert "staged KV from engine ranks [0, 1] did not cover the request" in str(recvs[0].failure_exception())
        assert_decode_staging_released(decode)


def test_error_after_a_finished_transfer_frees_each_staging_range_once():
    # regression: a DONE transfer was released, then released (and its staging freed) again
    # when a later transfer of the same room reported ERR. NIXL cannot be made to fail one
    # handle on demand, so this rank's check() is scripted: first transfer DONE, second ERR.
    with cluster(1, 2, 4) as (cfg, server, prefill, decode):
        mgr = prefill[0][0]
        senders, recvs = start(cfg, server, prefill, decode)
        senders[0].send(cfg["src_pages"])
        assert mgr.route_counts[KVRoute.PACKED] == 2  # two transfers, each holding staging
        first = mgr.prefill_rooms[7].handles[0]
        mgr.check = lambda t: "DONE" if t is first else "ERR"
        assert senders[0].poll() == KVPoll.Failed
        assert "NIXL transfer to decode-" in str(senders[0].failure_exception())
        assert mgr.staging.free_bytes() == mgr.staging.nbytes
        wait_all(recvs, KVPoll.Failed)  # decode hears ABORT



def test_gathers_run_one_piece_ahead_across_destinations():
    # 1 -> 2 in one-page pieces (7 per decode rank): each piece's gather is started before the
    # piece before it is posted, also from decode rank 0's last piece to decode rank 1's first
    with cluster(1, 2, 4, PIECES) as (cfg, server, prefill, decode):
        mgr, events = prefill[0][0], []
        start_gather, post = mgr._start_gather, mgr._post

        def logged_start(room, layout, pages):
            events.append("gather")
            return start_gather(room, layout, pages)

        def logged_post(remote, descs, notif, staging=None):
            events.append(remote)
            return post(remote, descs, notif, staging)

        mgr._start_gather, mgr._post = logged_start, logged_post
        senders, recvs = start(cfg, server, prefill, decode)
        senders[0].send(cfg["src_pages"])
        wait_all(senders + recvs, KVPoll.Success)
        posts = [decode[0][0].agent_name] * 7 + [decode[1][0].agent_name] * 7  # piece k goes to posts[k]
        assert events[:28] == ["gather"] + [x for name in posts[:-1] for x in ("gather", name)] + [posts[-1]]
        for r, (_, (kv, state, aux)) in enumerate(decode):
            assert check_decode(cfg, kv, state, aux, 2, r, 1) == []
        assert mgr.route_counts == Counter({KVRoute.PACKED: 14})


def test_failed_gather_fails_the_room_and_frees_all_staging():
    with cluster(1, 2, 4, PIECES) as (cfg, server, prefill, decode):
        mgr, calls = prefill[0][0], []
        real_copier = mgr.copier

        class FailingThird:
            def __init__(self, copier):
                self.copier = copier

            def gather(self, *args):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected gather failure")
                self.copier.gather(*args)

        mgr.copier = lambda layout: FailingThird(real_copier(layout))
        senders, recvs = start(cfg, server, prefill, decode)
        senders[0].send(cfg["src_pages"])
        assert senders[0].poll() == KVPoll.Failed
        assert "injected gather failure" in str(senders[0].failure_exception())
        assert len(calls) == 3 and mgr.route_counts == Counter({KVRoute.PACKED: 2})
        assert mgr.staging.free_bytes() == mgr.staging.nbytes
        wait_all(recvs, KVPoll.Failed)  # decode hears ABORT
        assert_decode_staging_released(decode)


def test_request_without_pages_completes_on_a_bare_notification():
    # regression: a bare notification (no bytes) as the first message to a decode was never
    # progressed on the prefill side (no handle to check), so decode timed out
    with cluster(1, 1, 4) as (cfg, server, prefill, decode):
        sender = NixlKVSender(prefill[0][0], server.addr, 9)
        sender.init(0)
        recv = NixlKVReceiver(decode[0][0], server.addr, 9)
        wait_all([recv], KVPoll.WaitingForInput)
        recv.init([])
        wait_all([sender], KVPoll.WaitingForInput)
        sender.send([])
        wait_all([sender, recv], KVPoll.Success, timeout=10)


def test_send_kvcache_slice_takes_upstreams_arguments_and_moves_each_decode_rank_its_heads():
    # upstream's send_kvcache_slice(peer_name, prefill_kv_indices, dst_kv_indices): the rest of
    # what it needs about the peer (pointers, item sizes, its heads) was fixed at REGISTER
    params = list(inspect.signature(NixlKVManager.send_kvcache_slice).parameters)
    assert params == ["self", "peer_name", "prefill_kv_indices", "dst_kv_indices", "notif"]
    with cluster(1, 2, 4, NO_STAGING, NO_STAGING) as (cfg, server, prefill, decode):
        start(cfg, server, prefill, decode)  # both decode ranks registered with the prefill rank
        mgr, (pkv, _, _) = prefill[0]
        src, dst = np.array([9, 3], dtype=np.int32), np.array([6, 13], dtype=np.int32)  # upstream's int32
        for r, (dmgr, (dkv, _, _)) in enumerate(decode):
            transfer = mgr.send_kvcache_slice(dmgr.agent_name, src, dst)  # no notification
            deadline = time.monotonic() + 10
            while mgr.check(transfer) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.002)
            assert mgr.check(transfer) == "DONE"
            mgr.finish(transfer)
            for name in ("k", "v"):
                got = dkv.buffers[name].view(2, -1, 4, 2, 4)[:, dst]
                sent = pkv.buffers[name].view(2, -1, 4, 4, 4)[:, src, :, 2 * r:2 * r + 2]
                assert torch.equal(got, sent), (r, name)
                assert (dkv.buffers[name].view(2, -1, 4, 2, 4)[:, [1, 7, 14]] == -7).all()  # nothing else
        with pytest.raises(ValueError, match="'nobody' is not a registered decode peer of prefill-0-"):
            mgr.send_kvcache_slice("nobody", src, dst)
        with pytest.raises(ValueError, match="page lists differ in length: src 2, dst 1"):
            mgr.send_kvcache_slice(decode[0][0].agent_name, src, dst[:1])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
