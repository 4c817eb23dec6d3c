"""NixlKVManager with real NIXL agents (two in one process, UCX loopback): refusals at
bootstrap, malformed input dropped without harm, timeout, abort, bad requests."""

import logging
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from mp_harness import free_port
from sglang.srt.disaggregation.base import DisaggregationMode, IncompatiblePeerError, KVArgs, KVPoll, TransferConfig
from sglang.srt.disaggregation.common.control import ControlChannel
from sglang.srt.disaggregation.common.messages import MsgKind
from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver, NixlKVSender
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")

PAGE = 4


def make(mode, addr, page_size=PAGE, layers=2, transfer_timeout=20.0, bootstrap_timeout=10.0):
    pool = MHATokenToKVPool(32, page_size, torch.float32, 2, 4, layers)
    aux = torch.zeros(4, 2, dtype=torch.int32)
    args = KVArgs.from_pools(pool, engine_rank=0, total_kv_head_num=2, aux_buffers=[aux])
    cfg = TransferConfig(bootstrap_addr=addr if mode is DisaggregationMode.PREFILL else None,
                         heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, bootstrap_timeout_s=bootstrap_timeout,
                         transfer_timeout_s=transfer_timeout)
    return NixlKVManager(args, mode, cfg), pool, aux


@pytest.fixture(scope="module")
def pair():
    server = NixlKVBootstrapServer()
    prefill, ppool, paux = make(DisaggregationMode.PREFILL, server.addr)
    decode, dpool, daux = make(DisaggregationMode.DECODE, None, transfer_timeout=1.5)
    for buf in ppool.buffers.values():
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf))
    paux.copy_(torch.arange(8, dtype=torch.int32).view(4, 2) + 100)
    yield server, prefill, decode, ppool, dpool, daux
    decode.close()
    prefill.close()
    server.close()


def until(fn, states, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = fn()
        if s in states:
            return s
        time.sleep(0.01)
    return fn()


def transfer(server, prefill, decode, room, src_pages, dst_pages):
    sender = NixlKVSender(prefill, server.addr, room)
    sender.init(len(src_pages), aux_index=1)
    recv = NixlKVReceiver(decode, server.addr, room)
    assert until(recv.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    recv.init(dst_pages, aux_index=3)
    assert until(sender.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    sender.send(src_pages)
    assert until(lambda: (sender.poll(), recv.poll())[1], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert until(sender.poll, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success


def test_transfer_moves_scattered_pages(pair):
    server, prefill, decode, ppool, dpool, daux = pair
    transfer(server, prefill, decode, 1, [5, 2, 3], [7, 1, 8])
    for name in ("k", "v"):
        src = ppool.buffers[name].view(2, -1, PAGE, 2, 4)[:, [5, 2, 3]]
        assert torch.equal(dpool.buffers[name].view(2, -1, PAGE, 2, 4)[:, [7, 1, 8]], src)
    assert daux[3].tolist() == [102, 103]
    assert prefill.num_active_rooms() == 0 and decode.num_active_rooms() == 0


def test_malformed_input_is_dropped_and_manager_keeps_working(pair, caplog):
    from nixl._api import nixl_agent, nixl_agent_config

    server, prefill, decode, *_ = pair
    caplog.set_level(logging.WARNING, logger="sglang.srt.disaggregation")
    replies = []
    fake = ControlChannel("127.0.0.1", "fake-decode", replies.append, lambda *a: None, 0.2, 3.0)
    rogue = nixl_agent("rogue", nixl_agent_config(backends=["UCX"]))
    try:
        for port in (prefill.control.port, decode.control.port):
            raw = fake._ctx.socket(zmq.PUSH)
            raw.connect(f"tcp://127.0.0.1:{port}")
            raw.send_multipart([b"garbage"])
            raw.send_multipart([b"sglang-pd-1", b"request", b"{broken"])
            raw.close(linger=1000)
        # an incompatible registration is refused with a REJECT naming both values
        bad_peer = dict(decode.peer_info.to_json(), page_size=8)
        header = {"ip": "127.0.0.1", "port": fake.port, "engine_rank": 9, "tp_rank": 0, "peer": bad_peer,
                  "kv_ptrs": [], "kv_lens": [], "aux_ptrs": [], "aux_lens": [], "state_ptrs": [], "state_lens": [],
                  "staging_ptr": 0, "staging_len": 0}
        fake.send_to("127.0.0.1", prefill.control.port, MsgKind.REGISTER, header, [b"not metadata"])
        # a request from an agent that never registered
        fake.send_to("127.0.0.1", prefill.control.port, MsgKind.REQUEST,
                     {"room": 5, "engine_rank": 9, "tp_rank": 0, "required_dst_info_num": 1, "send_kv": True,
                      "send_state": False, "send_aux": False, "aux_index": 0, "staging_offset": -1},
                     [np.array([1]), np.array([])])
        # notifications that are garbage, for unknown rooms, or from the wrong agent
        rogue.add_remote_agent(decode.agent.get_agent_metadata())
        for tag in (b"garbage", b"999|kv|0|0|1", b"1|kv|0|0|1"):
            rogue.send_notif(decode.agent_name, tag)
        deadline = time.monotonic() + 10
        while not replies and time.monotonic() < deadline:
            time.sleep(0.02)
        assert replies and replies[0].kind is MsgKind.REJECT
        assert "page_size mismatch: prefill 4 vs decode 8" in replies[0].header["reason"]
        deadline = time.monotonic() + 10
        while "dropped notification from rogue" not in caplog.text and time.monotonic() < deadline:
            decode.drain_notifs()
            time.sleep(0.02)
        transfer(server, prefill, decode, 2, [1], [2])  # both managers still work
        assert "fake-decode" not in prefill.decode_peers
        assert caplog.text.count("dropped malformed control message") >= 4
        assert "dropped request for room 5 from unregistered fake-decode" in caplog.text
        assert "dropped notification from rogue: bad notification tag b'garbage'" in caplog.text
    finally:
        fake.close()


def test_decode_timeout_fails_both_sides(pair):
    server, prefill, decode, *_ = pair
    sender = NixlKVSender(prefill, server.addr, 3)
    sender.init(2, aux_index=0)
    recv = NixlKVReceiver(decode, server.addr, 3)
    until(recv.poll, {KVPoll.WaitingForInput})
    recv.init([1, 2], aux_index=0)
    assert until(recv.poll, {KVPoll.Failed}, timeout=10) == KVPoll.Failed  # prefill never sends
    assert "transfer not done within 1.5s; missing KV from engine rank 0" in str(recv.failure_exception())
    assert until(sender.poll, {KVPoll.Failed}) == KVPoll.Failed
    assert "aborted" in str(sender.failure_exception())


@pytest.mark.parametrize("who", ["decode", "prefill"])
def test_abort_reaches_the_other_side(pair, who):
    server, prefill, decode, *_ = pair
    room = 10 if who == "decode" else 11
    sender = NixlKVSender(prefill, server.addr, room)
    sender.init(1)
    recv = NixlKVReceiver(decode, server.addr, room)
    until(recv.poll, {KVPoll.WaitingForInput})
    recv.init([3])
    until(sender.poll, {KVPoll.WaitingForInput})
    (recv if who == "decode" else sender).abort()
    other = sender if who == "decode" else recv
    assert until(other.poll, {KVPoll.Failed}) == KVPoll.Failed
    assert f"aborted by {who}" in str(other.failure_exception())
    assert prefill.num_active_rooms() == 0 and decode.num_active_rooms() == 0


def test_room_without_prefill_sender_is_dropped_when_decode_gives_up(pair):
    server, prefill, decode, *_ = pair
    recv = NixlKVReceiver(decode, server.addr, 60)
    until(recv.poll, {KVPoll.WaitingForInput})
    recv.init([2])
    deadline = time.monotonic() + 10
    while 60 not in prefill.prefill_rooms and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 60 in prefill.prefill_rooms  # opened by the request alone
    recv.abort()
    while prefill.num_active_rooms() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.num_active_rooms() == 0, "a room nobody drives must not linger"
    sender = NixlKVSender(prefill, server.addr, 60)  # a late sender learns the outcome at once
    assert sender.poll() == KVPoll.Failed
    assert "aborted by decode" in str(sender.failure_exception())


def test_bad_destination_pages_refused(pair):
    server, prefill, decode, *_ = pair
    recv = NixlKVReceiver(decode, server.addr, 20)
    until(recv.poll, {KVPoll.WaitingForInput})
    with pytest.raises(ValueError, match=r"kv_indices must be page ids in \[0, 9\), got \[1, 40\]"):
        recv.init([1, 40])
    decode.send_requests(20, np.array([1, 1]), None, np.zeros(0, dtype=np.int64))  # bypass init's check
    assert until(recv.poll, {KVPoll.Failed}) == KVPoll.Failed
    assert "destination page ids name the same id twice" in str(recv.failure_exception())


def test_incompatible_decode_refused_at_bootstrap(pair):
    server, *_ = pair
    decode, *_ = make(DisaggregationMode.DECODE, None, page_size=8)
    try:
        recv = NixlKVReceiver(decode, server.addr, 30)
        assert until(recv.poll, {KVPoll.Failed}) == KVPoll.Failed
        assert "page_size mismatch: prefill 4 vs decode 8" in str(recv.failure_exception())
    finally:
        decode.close()


def test_decode_started_before_prefill_waits_for_bootstrap():
    # regression: "connection refused" from a bootstrap server not yet listening failed the room
    port = free_port()
    decode, dpool, _ = make(DisaggregationMode.DECODE, None)
    server = prefill = None
    try:
        recv = NixlKVReceiver(decode, f"127.0.0.1:{port}", 40)
        assert until(recv.poll, {KVPoll.Failed}, timeout=0.5) == KVPoll.Bootstrapping
        server = NixlKVBootstrapServer(port=port)
        prefill, ppool, _ = make(DisaggregationMode.PREFILL, server.addr)
        ppool.buffers["k"].fill_(3.0)
        sender = NixlKVSender(prefill, server.addr, 40)
        sender.init(1)
        assert until(recv.poll, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
        recv.init([4])
        until(sender.poll, {KVPoll.WaitingForInput})
        sender.send([2])
        assert until(lambda: (sender.poll(), recv.poll())[1], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert bool((dpool.buffers["k"][:, 16:20] == 3.0).all())
    finally:
        for obj in (decode, prefill, server):
            if obj is not None:
                obj.close()


def test_unreachable_bootstrap_fails_after_timeout_with_reason():
    decode, *_ = make(DisaggregationMode.DECODE, None, bootstrap_timeout=0.5)
    try:
        recv = NixlKVReceiver(decode, f"127.0.0.1:{free_port()}", 41)
        assert until(recv.poll, {KVPoll.Failed}) == KVPoll.Failed
        assert "not ready within 0.5s (last error: bootstrap server" in str(recv.failure_exception())
        assert "unreachable" in str(recv.failure_exception())
    finally:
        decode.close()


def test_slow_bootstrap_lookup_never_blocks_poll(monkeypatch):
    """A lookup against a prefill server that does not answer waits out the HTTP timeout; it runs
    on the manager's lookup workers, so the receiver's constructor and polls (the decode
    scheduler's loop) return at once meanwhile, and the room still bootstraps once it answers."""
    server = NixlKVBootstrapServer()
    prefill, *_ = make(DisaggregationMode.PREFILL, server.addr)
    decode, *_ = make(DisaggregationMode.DECODE, None)
    real, release = decode.resolve_targets, threading.Event()

    def stalled(addr):
        release.wait(10)  # a peer that takes its time
        return real(addr)

    monkeypatch.setattr(decode.lookups, "_resolve", stalled)
    try:
        t0 = time.monotonic()
        recv = NixlKVReceiver(decode, server.addr, 55)
        polls = [recv.poll() for _ in range(20)]
        assert time.monotonic() - t0 < 1.0, "a poll waited for the lookup"
        assert set(polls) == {KVPoll.Bootstrapping}
        release.set()
        NixlKVSender(prefill, server.addr, 55).init(1)
        assert until(recv.poll, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
    finally:
        release.set()
        decode.close()
        prefill.close()
        server.close()


def test_late_request_for_a_failed_room_is_answered_with_abort():
    server = NixlKVBootstrapServer()
    prefill, *_ = make(DisaggregationMode.PREFILL, server.addr, bootstrap_timeout=0.5)
    decode, *_ = make(DisaggregationMode.DECODE, None)
    try:
        sender = NixlKVSender(prefill, server.addr, 50)
        sender.init(1)
        assert until(sender.poll, {KVPoll.Failed}) == KVPoll.Failed  # no decode came in time
        recv = NixlKVReceiver(decode, server.addr, 50)
        until(recv.poll, {KVPoll.WaitingForInput})
        recv.init([1])
        assert until(recv.poll, {KVPoll.Failed}, timeout=15) == KVPoll.Failed  # the reason below tells it from the 20 s timeout
        assert "decode destinations arrived within 0.5s" in str(recv.failure_exception())
        assert prefill.num_active_rooms() == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_mismatched_prefill_rank_refused_by_bootstrap(pair):
    server, *_ = pair
    with pytest.raises(IncompatiblePeerError, match="layer_num: this rank 3 vs registered 2"):
        make(DisaggregationMode.PREFILL, server.addr, layers=3)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
