"""KV + Mamba state of a tiny Qwen3-Next moved between PD managers over real NIXL (UCX loopback,
every rank's agent in this process), pools built from the model's own ``kv_pool_layout``.

For prefill TP -> decode TP 1 -> 1, 2 -> 1 and 1 -> 2, each decode rank's pages and state slot
must hold exactly its shard of one global request: KV heads, temporal-state value heads, and the
conv state's q | k | v channel segments, each sharded across TP on its own (a 2 -> 1 join is
q0 q1 | k0 k1 | v0 v1). A room completes only after every state sender reported. Also: the
transfer-plan table refuses pools it cannot move together, naming them.
"""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang.srt.disaggregation.base import DisaggregationMode, KVPoll, TransferConfig
from sglang.srt.disaggregation.common.pool_plan import kv_args_of_pools
from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver, NixlKVSender
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.dsa import DSAIndexerPool
from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

PAGE, TOKENS, SLOTS = 4, 32, 4
HF = SimpleNamespace(num_key_value_heads=2, head_dim=4, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                     linear_value_head_dim=2, linear_conv_kernel_dim=3)
SRC_PAGES, DST_PAGES = [5, 2, 3], [7, 1, 6]
SRC_SLOT, DST_SLOT = 3, 1
KD = HF.linear_num_key_heads * HF.linear_key_head_dim  # global q (and k) channels
VD = HF.linear_num_value_heads * HF.linear_value_head_dim


def shard(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    n = x.shape[0] // tp
    return x[rank * n:(rank + 1) * n]


def conv_shard(conv: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """A rank's conv channels: its slice of q, of k and of v, in that order (the model's layout)."""
    q, k, v = conv[:KD], conv[KD:2 * KD], conv[2 * KD:]
    return torch.cat([shard(q, tp, rank), shard(k, tp, rank), shard(v, tp, rank)])


def global_request(seed: int):
    """One request's bytes for a tp1 rank: KV per token (heads, dim), conv (channels, K - 1),
    temporal (value heads, dk, dv)."""
    g = torch.Generator().manual_seed(seed)
    n = len(SRC_PAGES) * PAGE
    return {"k": torch.randn(n, 2, 4, generator=g), "v": torch.randn(n, 2, 4, generator=g),
            "conv_0": torch.randn(2 * KD + VD, HF.linear_conv_kernel_dim - 1, generator=g),
            "temporal": torch.randn(HF.linear_num_value_heads, HF.linear_key_head_dim, HF.linear_value_head_dim,
                                    generator=g)}


def rank_view(req: dict, tp: int, rank: int) -> dict:
    return {"k": shard(req["k"].transpose(0, 1), tp, rank).transpose(0, 1),
            "v": shard(req["v"].transpose(0, 1), tp, rank).transpose(0, 1),
            "conv_0": conv_shard(req["conv_0"], tp, rank), "temporal": shard(req["temporal"], tp, rank)}


def slots_of(pages) -> torch.Tensor:
    return (torch.tensor(pages).view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)


def make_rank(mode, tp: int, rank: int, addr):
    layout = Qwen3NextForCausalLM.kv_pool_layout(HF, tp, torch.float32)
    kv, state = layout.anchor.build(TOKENS, PAGE, "cpu"), layout.state.build(SLOTS, 1, "cpu")
    aux = torch.zeros(4, 2, dtype=torch.int64)
    args = kv_args_of_pools(kv, [], state, engine_rank=rank, tp_rank=rank, tp_size=tp,
                            total_kv_head_num=HF.num_key_value_heads, aux_buffers=[aux])
    cfg = TransferConfig(bootstrap_addr=addr if mode is DisaggregationMode.PREFILL else None,
                         heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, bootstrap_timeout_s=10.0)
    return NixlKVManager(args, mode, cfg), kv, state, aux


def write(kv, state, view: dict, pages, slot: int) -> None:
    idx = slots_of(pages)
    for name in ("k", "v"):
        kv.buffers[name][0, idx] = view[name]
    for name in ("conv_0", "temporal"):
        state.buffers[name][0, slot] = view[name]


def until(fn, want, timeout=15.0):
    deadline = time.monotonic() + timeout
    state = fn()
    while state not in want and time.monotonic() < deadline:
        time.sleep(0.005)
        state = fn()
    return state


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2)], ids=["tp1-tp1", "tp2-tp1", "tp1-tp2"])
def test_kv_and_state_land_as_each_decode_ranks_shard(prefill_tp, decode_tp):
    server = NixlKVBootstrapServer()
    req = global_request(prefill_tp * 10 + decode_tp)
    prefill = [make_rank(DisaggregationMode.PREFILL, prefill_tp, r, server.addr) for r in range(prefill_tp)]
    decode = [make_rank(DisaggregationMode.DECODE, decode_tp, r, None) for r in range(decode_tp)]
    try:
        for r, (_, kv, state, aux) in enumerate(prefill):
            write(kv, state, rank_view(req, prefill_tp, r), SRC_PAGES, SRC_SLOT)
            aux[1] = torch.tensor([77, 1])
        room = 900 + prefill_tp * 10 + decode_tp
        senders = [NixlKVSender(m, server.addr, room) for m, *_ in prefill]
        receivers = [NixlKVReceiver(m, server.addr, room) for m, *_ in decode]
        for s in senders:
            s.init(len(SRC_PAGES), aux_index=1)
        for rcv in receivers:
            assert until(rcv.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            rcv.init(DST_PAGES, aux_index=2, state_indices=[DST_SLOT])
        for s in senders:
            assert until(s.poll, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        statuses = [m.decode_rooms[room].status for m, *_ in decode]
        assert [sorted(st.state_senders) for st in statuses] == [
            sorted(t.engine_rank for t in m.decode_rooms[room].targets) for m, *_ in decode]
        for s in senders:
            s.send(np.array(SRC_PAGES), np.array([SRC_SLOT]))
        for rcv in receivers:
            assert until(lambda: ([s.poll() for s in senders], rcv.poll())[1], {KVPoll.Success, KVPoll.Failed}) \
                == KVPoll.Success, rcv.failure_exception()
        for s in senders:
            assert until(s.poll, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        for r, (_, kv, state, aux) in enumerate(decode):
            want, idx = rank_view(req, decode_tp, r), slots_of(DST_PAGES)
            for name in ("k", "v"):
                assert torch.equal(kv.buffers[name][0, idx], want[name]), (r, name)
            for name in ("conv_0", "temporal"):
                assert torch.equal(state.buffers[name][0, DST_SLOT], want[name]), (r, name)
                assert not state.buffers[name][0, DST_SLOT + 1].any()  # nothing beside the slot
            assert aux[2].tolist() == [77, 1]
        assert all(m.num_active_rooms() == 0 for m, *_ in prefill + decode)
    finally:
        for m, *_ in decode + prefill:
            m.close()
        server.close()


def test_plan_table_refuses_pools_it_cannot_move_together():
    mha = MHATokenToKVPool(TOKENS, PAGE, torch.float32, 2, 4, 1)
    side = DSAIndexerPool(TOKENS, PAGE, 8, 1, torch.float32)
    with pytest.raises(ValueError, match=r"mha \(head_sliced_pages\), dsa_indexer \(whole_pages\) differ"):
        kv_args_of_pools(mha, [side], None, engine_rank=0, tp_rank=0, tp_size=1, total_kv_head_num=2)


def test_state_segments_must_agree_at_bootstrap():
    """A decode whose conv state splits into other segments is refused before any byte moves."""
    from sglang.srt.disaggregation.base import IncompatiblePeerError
    from sglang.srt.disaggregation.common.compat import PeerInfo, check_peer_compat

    def peer(tp: int, segments) -> PeerInfo:
        kv = MHATokenToKVPool(TOKENS, PAGE, torch.float32, 2 // tp, 4, 1)
        state = Qwen3NextForCausalLM.kv_pool_layout(HF, tp, torch.float32).state.build(SLOTS, 1, "cpu")
        if segments is not None:
            state.row_segments = {**state.row_segments, "conv_0": segments}
        args = kv_args_of_pools(kv, [], state, engine_rank=0, tp_rank=0, tp_size=tp, total_kv_head_num=2)
        return PeerInfo.from_json(json.loads(json.dumps(PeerInfo.from_kv_args(args).to_json())))  # as on the wire

    check_peer_compat(peer(2, None), peer(1, None))
    with pytest.raises(IncompatiblePeerError, match="state buffer 1 TP segments mismatch"):
        check_peer_compat(peer(2, None), peer(1, (2 * KD + VD,)))
