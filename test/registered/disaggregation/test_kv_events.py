"""``--kv-events-config`` and the publishers: the config is validated naming what is allowed,
the wire payload is upstream's MessagePack layout (checked with an independent decoder), and a
zmq publisher delivers batches in order over PUB and replays them over ROUTER."""

import json
import struct
import time

import pytest
import zmq

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVEventBatch,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    encode_event_batch,
    offset_endpoint_port,
)
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

DEADLINE_S = 30


def unpack(data: bytes):
    """A small MessagePack decoder, written from the spec (not from the encoder under test)."""

    def read(i):
        b = data[i]
        if b <= 0x7F:
            return b, i + 1
        if b >= 0xE0:
            return b - 0x100, i + 1
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
            return data[i + 1 : i + 1 + n].decode(), i + 1 + n
        if 0x90 <= b <= 0x9F:
            return seq(b & 0x0F, i + 1)
        if 0x80 <= b <= 0x8F:
            return mapping(b & 0x0F, i + 1)
        fixed = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in fixed:
            return fixed[b], i + 1
        fmt = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
               0xCB: ">d"}
        if b in fmt:
            size = struct.calcsize(fmt[b])
            return struct.unpack(fmt[b], data[i + 1 : i + 1 + size])[0], i + 1 + size
        if b in (0xD9, 0xDA, 0xDB):
            size = {0xD9: 1, 0xDA: 2, 0xDB: 4}[b]
            n = int.from_bytes(data[i + 1 : i + 1 + size], "big")
            start = i + 1 + size
            return data[start : start + n].decode(), start + n
        if b in (0xDC, 0xDD):
            size = 2 if b == 0xDC else 4
            return seq(int.from_bytes(data[i + 1 : i + 1 + size], "big"), i + 1 + size)
        if b in (0xDE, 0xDF):
            size = 2 if b == 0xDE else 4
            return mapping(int.from_bytes(data[i + 1 : i + 1 + size], "big"), i + 1 + size)
        raise AssertionError(f"unexpected MessagePack byte {b:#x}")

    def seq(n, i):
        out = []
        for _ in range(n):
            v, i = read(i)
            out.append(v)
        return out, i

    def mapping(n, i):
        out = {}
        for _ in range(n):
            k, i = read(i)
            out[k], i = read(i)
        return out, i

    value, end = read(0)
    assert end == len(data)
    return value


def batch(*events, ts=1.5) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))


STORED = BlockStored([-(1 << 62), 7], None, [1, 2, 300, 70000], 2, None, medium="GPU")


def test_payload_is_upstreams_tagged_layout():
    payload = encode_event_batch(KVEventBatch(ts=2.25, events=[
        STORED, BlockRemoved([5], medium="CPU_PINNED"), AllBlocksCleared()], attn_dp_rank=0))
    assert unpack(payload) == [2.25, [
        {"type": "BlockStored", "block_hashes": [-(1 << 62), 7], "parent_block_hash": None,
         "token_ids": [1, 2, 300, 70000], "block_size": 2, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU_PINNED"},
        {"type": "AllBlocksCleared"},
    ], 0]
    long = encode_event_batch(batch(BlockRemoved(list(range(-40, 40)), medium="x" * 40)))
    assert unpack(long)[1][0]["block_hashes"] == list(range(-40, 40))


def test_config_is_validated_naming_what_is_allowed():
    assert KVEventsConfig.from_cli('{"publisher": "zmq", "topic": "kv"}').topic == "kv"
    bad = {
        '{"publisher": "kafka"}': "choose one of: null, zmq",
        '{"format": "dynamo"}': "choose one of: default",
        '{"endpoint": "udp://x:1"}': "tcp://, ipc:// or inproc://",
        '{"hwm": 0}': "int >= 1",
        '{"publisher": "null", "colour": 1}': "unknown keys \\['colour'\\]",
        '[1]': "JSON object",
        '{oops': "not valid JSON",
    }
    for value, message in bad.items():
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.from_cli(value)
        with pytest.raises(ValueError, match=message):
            ServerArgs(model_path="m", kv_events_config=value)
    with pytest.raises(ValueError, match="needs the radix cache"):
        ServerArgs(model_path="m", kv_events_config="{}", disable_radix_cache=True)
    assert ServerArgs(model_path="m").kv_events_config is None


def test_factory_builds_the_named_publisher():
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)
    null = EventPublisherFactory.create('{"publisher": "null"}')
    null.publish(batch(STORED))
    null.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        null.publish(batch(STORED))
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def _recv(sock, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not sock.poll(50):
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s"
    return sock.recv_multipart()


def test_zmq_publisher_sends_in_order_and_replays():
    config = json.dumps({"publisher": "zmq", "endpoint": "inproc://kv-events-test", "topic": "kv",
                         "replay_endpoint": "inproc://kv-events-replay", "buffer_steps": 4})
    pub = EventPublisherFactory.create(config)
    assert isinstance(pub, ZmqEventPublisher)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect("inproc://kv-events-test")
    try:
        # PUB drops what it sends before the subscription arrives: probe until one gets through
        deadline = time.monotonic() + DEADLINE_S
        while True:
            pub.publish(batch(AllBlocksCleared(), ts=0.0))
            if sub.poll(50):
                break
            assert time.monotonic() < deadline, "subscription never reached the publisher"
        topic, seq, payload = sub.recv_multipart()
        first = int.from_bytes(seq, "big")
        while sub.poll(200):  # probes still queued behind the first
            first = int.from_bytes(sub.recv_multipart()[1], "big")
        pub.publish(batch(STORED, ts=3.0))
        pub.publish(batch(BlockRemoved([7], medium="GPU"), ts=4.0))
        got = [_recv(sub, "batch") for _ in range(2)]
        assert [int.from_bytes(s, "big") for _, s, _ in got] == [first + 1, first + 2]
        assert [t for t, _, _ in got] == [b"kv", b"kv"]
        assert [unpack(p)[0] for _, _, p in got] == [3.0, 4.0]
        assert unpack(got[0][2])[1][0]["token_ids"] == [1, 2, 300, 70000] and unpack(got[0][2])[2] == 0
        # replay from first + 1: both batches, byte for byte, then the end marker
        req = ctx.socket(zmq.DEALER)
        req.connect("inproc://kv-events-replay")
        req.send_multipart((b"", (first + 1).to_bytes(8, "big")))
        replayed = [_recv(req, "replay") for _ in range(3)]
        assert [r[1:] for r in replayed[:2]] == [list(g) for g in got]
        assert replayed[2][2] == ZmqEventPublisher.END_SEQ
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(batch(STORED))
