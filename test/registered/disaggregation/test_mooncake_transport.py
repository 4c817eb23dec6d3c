"""MooncakeTransport's contract with the PD manager, on a scripted engine (no network): a tag
goes out only after its whole WRITE succeeded, never for a failed or released one; batches are
split; metadata from another backend is refused; the engine's settings come from the config.
"""

import json
import threading

import numpy as np
import pytest

import sglang.srt.disaggregation.mooncake.transport as mt
from sglang.srt.disaggregation.base import KVTransferError, TransferConfig
from sglang.srt.disaggregation.common.descriptors import Descs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


class ScriptedEngine:
    def __init__(self):
        self.calls, self.codes, self.gate = [], [], None
        self.init_args = None

    def initialize(self, *args):
        self.init_args = args
        return 0

    def get_rpc_port(self):
        return 4321

    def batch_register_memory(self, ptrs, lens):
        return 0

    def batch_unregister_memory(self, ptrs):
        return 0

    def batch_transfer_sync_write(self, session, src, dst, lens):
        if self.gate is not None:
            self.gate[0].set()
            self.gate[1].wait(10)
        self.calls.append((session, list(src), list(dst), list(lens)))
        return self.codes.pop(0) if self.codes else 0


@pytest.fixture
def transport(monkeypatch):
    for name in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
        monkeypatch.setenv(name, "7")  # undone after the test (the transport only sets unset ones)
    engine = ScriptedEngine()
    monkeypatch.setattr(mt, "load_transfer_engine", lambda: lambda: engine)
    sent = []
    t = mt.MooncakeTransport("prefill-0", TransferConfig(mooncake_protocol="tcp", mooncake_device="dev0"),
                             lambda peer, tag: sent.append((peer, tag)) or True)
    peer = mt.MooncakeTransport.__new__(mt.MooncakeTransport)  # only its metadata is needed
    peer.backend, peer.session = "mooncake", "127.0.0.1:999"
    t.add_peer("decode-0", peer.local_metadata())
    yield t, engine, sent
    t.close()


def _descs(n: int) -> Descs:
    src = np.zeros((n, 3), dtype=np.uint64)
    dst = np.zeros((n, 3), dtype=np.uint64)
    src[:, 0], dst[:, 0] = np.arange(n) * 16 + 1000, np.arange(n) * 16 + 5000
    src[:, 1] = dst[:, 1] = 16
    return Descs(src, dst)


def _wait(t, handle):
    handle.future.result(10)
    return t.check(handle)


def test_engine_started_from_config(transport):
    t, engine, _ = transport
    assert engine.init_args == ("127.0.0.1", "P2PHANDSHAKE", "tcp", "dev0")
    assert t.session == "127.0.0.1:4321"
    assert json.loads(t.local_metadata()) == {"backend": "mooncake", "session": "127.0.0.1:4321"}


def test_tag_follows_a_whole_successful_write_split_in_batches(transport, monkeypatch):
    t, engine, sent = transport
    monkeypatch.setattr(mt, "MAX_BATCH", 2)
    h = t.post_write("decode-0", _descs(5), b"7|kv|0|0|1|0|5")
    assert _wait(t, h) == "DONE"
    assert [len(c[1]) for c in engine.calls] == [2, 2, 1]
    assert engine.calls[0][:2] == ("127.0.0.1:999", [1000, 1016])
    assert sent == [("decode-0", b"7|kv|0|0|1|0|5")]


def test_failed_write_is_err_and_sends_no_tag(transport):
    t, engine, sent = transport
    engine.codes = [-1]
    assert _wait(t, t.post_write("decode-0", _descs(3), b"7|kv|0|0|1|0|3")) == "ERR"
    assert sent == []


def test_released_while_writing_sends_no_tag(transport):
    t, engine, sent = transport
    started, go = threading.Event(), threading.Event()
    engine.gate = (started, go)
    h = t.post_write("decode-0", _descs(1), b"7|aux|0|0|0")
    assert started.wait(10)
    assert t.check(h) == "PROC"
    t.release(h)  # the room failed while the write ran
    go.set()
    assert _wait(t, h) == "ERR" and sent == []


def test_unsent_tag_is_err(transport):
    t, _, _ = transport
    t._notify = lambda peer, tag: False
    assert _wait(t, t.post_write("decode-0", _descs(1), b"7|aux|0|0|0")) == "ERR"
    with pytest.raises(KVTransferError):
        t.send_notif("decode-0", b"7|kv|0|1|1|0|0")


def test_unknown_peer_and_foreign_metadata_refused(transport):
    t, _, _ = transport
    with pytest.raises(KVTransferError, match="not a registered peer"):
        t.post_write("decode-9", _descs(1), b"x")
    for bad in (b"\x00nixl-agent-metadata", json.dumps({"backend": "nixl", "session": "h:1"}).encode(),
                json.dumps({"backend": "mooncake", "session": "nohost"}).encode()):
        with pytest.raises(ValueError, match="--disaggregation-transfer-backend"):
            t.add_peer("decode-1", bad)



def test_backend_classes():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    from sglang.srt.disaggregation.utils import get_kv_class

    assert [get_kv_class("mooncake", k) for k in ("manager", "sender", "receiver")] == [
        MooncakeKVManager, MooncakeKVSender, MooncakeKVReceiver]
    assert get_kv_class("nixl", "manager") is NixlKVManager
    with pytest.raises(ValueError, match="nixl"):
        get_kv_class("mori", "manager")
