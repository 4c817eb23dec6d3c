"""Decode staging of a failed or aborted room is quarantined like its pool pages (issue 27).

A WRITE prefill posted before it heard of the failure can still land in the room's staging
range. Before the fix the range went back to the free list at once, so the next room was given
the very same bytes and a late WRITE could land in them; now the range stays out of use for
``heartbeat_timeout_s`` (a live prefill has seen the ABORT by then, a silent one is dead), then
is freed. Real NIXL agents (UCX loopback); staging forced with a high descriptor cost.
"""

import time

import pytest
import torch

from sglang.srt.disaggregation.base import DisaggregationMode, KVArgs, KVPoll, TransferConfig
from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver, NixlKVSender
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PAGE = 4
QUARANTINE_S = 1.5  # heartbeat_timeout_s of both managers


def make(mode, addr=None):
    pool = MHATokenToKVPool(64, PAGE, torch.float32, 2, 4, 2)
    aux = torch.zeros(4, 2, dtype=torch.int32)
    args = KVArgs.from_pools(pool, engine_rank=0, total_kv_head_num=2, aux_buffers=[aux])
    cfg = TransferConfig(bootstrap_addr=addr, heartbeat_interval_s=0.2, heartbeat_timeout_s=QUARANTINE_S,
                         descriptor_cost_bytes=1 << 30)  # every request goes through decode's staging
    mgr = NixlKVManager(args, mode, cfg)
    mgr.test_buffers = (pool, aux)  # registered with NIXL: they must outlive the manager
    return mgr, pool


def until(fn, states, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = fn()
        if s in states:
            return s
        time.sleep(0.01)
    return fn()


@pytest.fixture()
def pair():
    server = NixlKVBootstrapServer()
    prefill, ppool = make(DisaggregationMode.PREFILL, server.addr)
    decode, dpool = make(DisaggregationMode.DECODE)
    yield server, prefill, decode, ppool, dpool
    decode.close()
    prefill.close()
    server.close()


def open_room(server, prefill, decode, room: int, dst_pages: list[int]):
    sender = NixlKVSender(prefill, server.addr, room)
    sender.init(len(dst_pages), aux_index=1)
    recv = NixlKVReceiver(decode, server.addr, room)
    assert until(recv.poll, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
    recv.init(dst_pages, aux_index=2)
    (staged,) = decode.decode_rooms[room].staged
    return sender, recv, (staged.offset, staged.offset + staged.nbytes)


@pytest.mark.parametrize("how", ["decode_abort", "prefill_abort"])
def test_failed_room_staging_is_not_handed_to_the_next_room(pair, how):
    server, prefill, decode, ppool, dpool = pair
    sender_a, recv_a, range_a = open_room(server, prefill, decode, 1, [3, 4])
    assert until(sender_a.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    (recv_a if how == "decode_abort" else sender_a).abort()
    assert until(recv_a.poll, {KVPoll.Failed}) == KVPoll.Failed
    assert until(sender_a.poll, {KVPoll.Failed}) == KVPoll.Failed
    # the next room gets other bytes: a WRITE prefill posted for room 1 cannot land in them
    ppool.buffers["k"].fill_(2.0)
    sender_b, recv_b, range_b = open_room(server, prefill, decode, 2, [5, 6])
    assert range_b[0] >= range_a[1] or range_b[1] <= range_a[0], f"room 2 staging {range_b} reuses room 1's {range_a}"
    assert decode.staging_quarantined_bytes >= range_a[1] - range_a[0]
    assert until(sender_b.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    sender_b.send([1, 2])
    assert until(lambda: (sender_b.poll(), recv_b.poll())[1], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert bool((dpool.buffers["k"][:, 5 * PAGE:7 * PAGE] == 2.0).all())
    # after the quarantine every byte is free again (nothing leaks); a tick frees it unpolled
    deadline = time.monotonic() + QUARANTINE_S + 10
    while decode.staging_quarantined_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.staging.free_bytes() == decode.staging.nbytes
    assert decode.num_active_rooms() == 0 and prefill.num_active_rooms() == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
