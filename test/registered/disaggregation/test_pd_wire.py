"""KVArgs validation, peer compatibility, control messages, notification tags."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.base import IncompatiblePeerError, KVArgs, KVPoll, StateType
from sglang.srt.disaggregation.common.compat import PeerInfo, check_peer_compat
from sglang.srt.disaggregation.common.messages import (
    MAGIC,
    MalformedMessage,
    MsgKind,
    Notif,
    NotifKind,
    decode_message,
    encode_message,
)
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def mha_args(tp_size=1, tp_rank=0, heads=4, page_size=4, head_dim=8, layers=2, dtype=torch.float16, total=None):
    pool = MHATokenToKVPool(32, page_size, dtype, max(1, heads // tp_size), head_dim, layers)
    return KVArgs.from_pools(pool, engine_rank=tp_rank, tp_rank=tp_rank, tp_size=tp_size,
                             total_kv_head_num=heads if total is None else total), pool


def test_kvpoll_is_an_intenum_with_upstream_values():
    assert [int(s) for s in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                             KVPoll.Success)] == [0, 1, 2, 3, 4]


def test_kv_args_from_pools_reads_layout():
    args, pool = mha_args(tp_size=2, tp_rank=1, heads=4)
    assert len(args.kv_data_ptrs) == 4 and args.kv_item_lens == [2 * 8 * 2] * 4
    assert args.kv_data_ptrs[0] == pool.buffers["k"][0].data_ptr()
    assert args.num_kv_pages == [9] * 4  # 8 pages + the reserved page 0
    mla = MLATokenToKVPool(16, 4, torch.bfloat16, 6, 2, 3)
    a = KVArgs.from_pools(mla, engine_rank=0)
    assert a.is_mla and a.head_dim == 8 and a.kv_dtype == "bfloat16"
    mamba = MambaPool(4, [(6, 3)], (6, 2, 2), 3, conv_dtype=torch.float32)
    a = KVArgs.from_pools(mla, engine_rank=0, state_pool=mamba)
    assert a.state_type is StateType.MAMBA and a.state_dim_per_tensor == [6] * 6


def test_total_heads_fallback_never_below_one():
    args, _ = mha_args(tp_size=2, heads=4, total=0)
    assert args.effective_total_kv_head_num == 4  # kv_head_num 2 x tp 2
    args.total_kv_head_num = 8
    assert args.effective_total_kv_head_num == 8


@pytest.mark.parametrize("change,match", [
    ({"tp_rank": 2}, "tp_rank 2 outside"),
    ({"kv_item_lens": [4]}, "kv lists differ in length"),
    ({"page_size": 0}, "page_size must be >= 1, got 0"),
    ({"pp_size": 2}, "pp_size 2 is not supported"),
    ({"state_type": "mamba"}, "state_type 'mamba' with 0 state buffers"),
])
def test_kv_args_bad_input_names_values(change, match):
    base = dict(engine_rank=0, kv_data_ptrs=[4096, 8192], kv_data_lens=[4096, 4096], kv_item_lens=[16, 16],
                page_size=4, kv_head_num=1, head_dim=8, layer_num=1, kv_dtype="float16", tp_size=2)
    with pytest.raises(ValueError, match=match):
        KVArgs(**{**base, **change})


def peer(**kw) -> PeerInfo:
    args, _ = mha_args(**kw)
    return PeerInfo.from_kv_args(args)


@pytest.mark.parametrize("decode_kw,match", [
    ({"page_size": 8}, "page_size mismatch: prefill 4 vs decode 8"),
    ({"dtype": torch.bfloat16}, "kv_dtype mismatch: prefill 'float16' vs decode 'bfloat16'"),
    ({"head_dim": 16}, "head_dim mismatch: prefill 8 vs decode 16"),
    ({"layers": 3}, "layer_num mismatch: prefill 2 vs decode 3"),
    ({"heads": 8, "tp_size": 2}, "total_kv_head_num mismatch: prefill 4 vs decode 8"),
])
def test_incompatible_peers_refused_naming_both(decode_kw, match):
    with pytest.raises(IncompatiblePeerError, match=match):
        check_peer_compat(peer(), peer(**decode_kw))


def test_unmappable_tp_refused():
    with pytest.raises(IncompatiblePeerError, match="prefill tp_size 4 and decode tp_size 3"):
        check_peer_compat(peer(tp_size=4, heads=12), peer(tp_size=3, heads=12))
    check_peer_compat(peer(tp_size=2, heads=2), peer(tp_size=8, heads=2))  # replication is fine


def test_peer_info_json_round_trip_and_bad_fields():
    p = peer()
    assert PeerInfo.from_json(json.loads(json.dumps(p.to_json()))) == p
    bad = dict(p.to_json(), page_size="4")
    with pytest.raises(ValueError, match="'page_size' must be int"):
        PeerInfo.from_json(bad)
    with pytest.raises(ValueError, match="lacks field 'kv_dtype'"):
        PeerInfo.from_json({k: v for k, v in p.to_json().items() if k != "kv_dtype"})


def request_header(**kw):
    return {"agent_name": "d", "room": 1, "engine_rank": 0, "tp_rank": 0, "required_dst_info_num": 1,
            "send_kv": True, "send_state": False, "send_aux": True, "aux_index": 2, "staging_offset": -1, **kw}


def test_message_round_trip():
    pages = np.array([5, 1, 9], dtype=np.int64)
    frames = encode_message(MsgKind.REQUEST, request_header(), [pages, np.zeros(0)])
    msg = decode_message(frames)
    assert msg.kind is MsgKind.REQUEST and msg.header["aux_index"] == 2
    assert msg.int64_blob(0).tolist() == [5, 1, 9] and msg.int64_blob(1).size == 0


@pytest.mark.parametrize("frames,match", [
    ([], "empty message"),
    ([b"junk", b"request", b"{}"], "not a PD control message"),
    ([MAGIC, b"nope", b"{}"], "unknown message kind"),
    ([MAGIC, b"abort", b"{not json"], "header is not JSON"),
    ([MAGIC, b"abort", b"[1]"], "header must be an object"),
    ([MAGIC, b"abort", json.dumps({"agent_name": "a", "room": 1}).encode()], "missing field 'reason'"),
    ([MAGIC, b"abort", json.dumps({"agent_name": "a", "room": True, "reason": ""}).encode()], "'room' must be int"),
    (encode_message(MsgKind.REQUEST, request_header(), [b"123", b""]), "int64 arrays"),
    (encode_message(MsgKind.REQUEST, request_header(), [b""]), "expected 2 binary frames"),
])
def test_malformed_messages_raise(frames, match):
    with pytest.raises(MalformedMessage, match=match):
        decode_message(frames)


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_random_frames_never_escape_as_other_errors(frames):
    try:
        decode_message(frames)
    except MalformedMessage:
        pass


def test_notif_round_trip_and_is_last_parsed_as_int_pitfall_12():
    n = Notif(77, NotifKind.KV, 3, 2, False)
    assert Notif.parse(n.encode()) == n
    assert Notif.parse(b"77|kv|3|2|0").is_last is False  # bool("0") would say True
    assert Notif.parse(b"77|kv|3|2|1").is_last is True
    for raw in (b"77|kv|3|2|2", b"77|kv|3|2", b"x|kv|3|2|0", b"77|blob|3|2|0", b"77|kv|-1|0|0", b"\xff",
                b"77|kv|3|2|0|4", b"77|kv|3|2|0|-1|2", b"77|kv|3|2|0|4|x", b"77|kv|3|2|0|4|2|9"):
        with pytest.raises(MalformedMessage):
            Notif.parse(raw)


def test_notif_carries_the_request_pages_of_a_kv_chunk():
    n = Notif(77, NotifKind.KV, 3, 2, True, first_page=12, num_pages=5)
    assert n.encode() == b"77|kv|3|2|1|12|5"
    assert Notif.parse(n.encode()) == n
    assert Notif.parse(b"77|kv|3|2|1") == Notif(77, NotifKind.KV, 3, 2, True, 0, 0)  # range left out


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_staging_area_first_fit_merge_and_double_free():
    from sglang.srt.disaggregation.common.staging import ALIGN, StagingArea

    area = StagingArea(4 * ALIGN)
    a, b, c = area.alloc(ALIGN), area.alloc(ALIGN + 1), area.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and area.alloc(1) is None
    area.free(b, ALIGN + 1)
    assert area.alloc(2 * ALIGN) == ALIGN  # the freed run is reused
    area.free(a, ALIGN)
    with pytest.raises(ValueError, match="already free"):
        area.free(a, ALIGN)
    area.free(ALIGN, 2 * ALIGN)
    area.free(c, ALIGN)
    assert area.free_bytes() == 4 * ALIGN and area.alloc(4 * ALIGN) == 0  # merged back into one run
