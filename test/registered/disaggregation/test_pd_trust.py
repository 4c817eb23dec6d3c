"""A PD control plane that trusts only its peers (issue 27).

Decode never sends a bootstrap server (nor, through it, a prefill rank) its NIXL metadata and
pool descriptors unless the host is well formed and allowed, and, with the deployment's shared
secret, unless the server proves it holds the secret. Bootstrap records are not replaceable by
a stranger; a request body's size is checked before it is read; a host that never answers
delays only the rooms that name it; control messages a stranger sends are dropped unread.
Real NIXL agents, real HTTP and ZMQ sockets on loopback.
"""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from mp_harness import free_port
from sglang.srt.disaggregation.base import (
    DisaggregationMode,
    IncompatiblePeerError,
    KVArgs,
    KVPoll,
    TransferConfig,
    UntrustedPeerError,
)
from sglang.srt.disaggregation.common.bootstrap import MAX_BODY_BYTES, CommonKVBootstrapServer
from sglang.srt.disaggregation.common.bootstrap_client import BootstrapClient
from sglang.srt.disaggregation.common.compat import PeerInfo
from sglang.srt.disaggregation.common.control import ControlChannel
from sglang.srt.disaggregation.common.messages import MsgKind
from sglang.srt.disaggregation.common.trust import BootstrapAddr, PeerAuth, TrustPolicy
from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver, NixlKVSender
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="per-commit-cpu")

SECRET = b"s3cret-of-this-deployment-0123456789"
PAGE = 4


def make(mode, addr=None, **conf):
    pool = MHATokenToKVPool(32, PAGE, torch.float32, 2, 4, 2)
    aux = torch.zeros(4, 2, dtype=torch.int32)
    args = KVArgs.from_pools(pool, engine_rank=0, total_kv_head_num=2, aux_buffers=[aux])
    cfg = TransferConfig(bootstrap_addr=addr if mode is DisaggregationMode.PREFILL else None,
                         heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, bootstrap_timeout_s=20.0, **conf)
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


def record(tp_rank=0, agent="prefill-0"):
    pool = MHATokenToKVPool(16, PAGE, torch.float16, 2, 8, 2)
    args = KVArgs.from_pools(pool, engine_rank=tp_rank, tp_rank=tp_rank, tp_size=2, total_kv_head_num=4)
    return {"engine_rank": tp_rank, "tp_rank": tp_rank, "ip": "127.0.0.1", "port": 5000 + tp_rank,
            "agent_name": agent, "peer": PeerInfo.from_kv_args(args).to_json()}


def http(addr: str, method: str, path: str, body: bytes | None = None, headers=None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{addr}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Listener:
    """A TCP port on ``host`` that counts connections and never answers (a black hole, or a
    spy that must never be contacted)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.addr = f"{host}:{self.sock.getsockname()[1]}"
        self.accepted, self.conns, self._stop = 0, [], threading.Event()
        self.sock.settimeout(0.05)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self.conns.append(conn)  # held open, never answered

    def close(self):
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


# ---- addresses and the allow-list -----------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example/x?y=", "a@b", "127.0.0.1:80", "host name", "fe80::1%eth0",
                                  "", "-bad.example", "ex\u00e4mple.com", "a" * 64 + ".example", None, 7])
def test_malformed_bootstrap_hosts_refused(host):
    with pytest.raises(ValueError):
        BootstrapAddr(host, 8998)


@pytest.mark.parametrize("port", [0, 65536, -1, "8998", True, None])
def test_bad_bootstrap_ports_refused(port):
    with pytest.raises(ValueError):
        BootstrapAddr("127.0.0.1", port)


def test_urls_are_built_from_parts():
    assert BootstrapAddr("::1", 80).url("/route", {"tp_rank": 3}) == "http://[::1]:80/route?tp_rank=3"
    assert BootstrapAddr.parse("[::1]:80") == BootstrapAddr("::1", 80)
    assert BootstrapAddr("prefill-0.cluster.local", 8998).url("/route") == "http://prefill-0.cluster.local:8998/route"
    with pytest.raises(ValueError, match="must be 'host:port'"):
        BootstrapAddr.parse("127.0.0.1")


def test_allow_list_and_secret_policy():
    policy = TrustPolicy()  # default: loopback only
    for host in ("127.0.0.1", "127.3.4.5", "::1", "localhost"):
        policy.check_host(host)
    for host in ("10.0.0.5", "prefill.example"):
        with pytest.raises(UntrustedPeerError, match="not in this server's allowed bootstrap hosts"):
            policy.check_host(host)
    with pytest.raises(ValueError, match=r"admits hosts off loopback \(10\.0\.0\.0/24\) but SGLANG_DISAGGREGATION_SECRET"):
        TrustPolicy(("127.0.0.1", "10.0.0.0/24"))
    policy = TrustPolicy(("10.0.0.0/24", "Prefill.Example"), SECRET)
    policy.check_host("10.0.0.9")
    policy.check_host("prefill.example")
    with pytest.raises(UntrustedPeerError):
        policy.check_host("10.0.1.9")
    with pytest.raises(UntrustedPeerError):
        policy.check_host("127.0.0.1")  # not listed
    assert "s3cret" not in repr(TransferConfig(secret=SECRET)) and "s3cret" not in repr(PeerAuth(SECRET))


def test_decode_never_contacts_a_host_outside_the_allow_list():
    spy = Listener("127.0.0.2")  # loopback, so reachable here, but not in this decode's allow-list
    decode, _ = make(DisaggregationMode.DECODE, allowed_bootstrap_hosts=("127.0.0.1",))
    try:
        with pytest.raises(UntrustedPeerError, match="'127.0.0.2' is not in this server's allowed bootstrap hosts"):
            NixlKVReceiver(decode, spy.addr, 1)
        with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
            NixlKVReceiver(decode, "127.0.0.2/route?x=:80", 2)
        time.sleep(0.3)
        assert spy.accepted == 0 and decode.num_active_rooms() == 0
    finally:
        decode.close()
        spy.close()


# ---- the bootstrap server ---------------------------------------------------------------------

@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_stranger_cannot_replace_a_registered_rank(secret):
    server = CommonKVBootstrapServer(secret=secret)
    try:
        client = BootstrapClient(server.addr, auth=PeerAuth(secret))
        client.register_rank(record(0))
        with pytest.raises(IncompatiblePeerError, match="tp_rank 0 is already registered by agent prefill-0"):
            client.register_rank(dict(record(0, agent="stranger"), ip="127.0.0.9", port=6666))
        with pytest.raises(IncompatiblePeerError, match="only the same record may be registered again"):
            client.register_rank(dict(record(0), port=6666))  # the agent's public name does not redirect it
        client.register_rank(record(0))  # the same agent may register again (a retried PUT)
        assert server.rank_record(0)["agent_name"] == "prefill-0" and server.rank_record(0)["port"] == 5000
    finally:
        server.close()


def test_with_a_secret_every_registration_and_lookup_is_authenticated():
    server = CommonKVBootstrapServer(secret=SECRET)
    try:
        body = b'{"tp_rank": 0}'
        assert http(server.addr, "PUT", "/route", body)[0] == 401  # no MAC
        stranger = BootstrapClient(server.addr, auth=PeerAuth(b"not-the-secret-of-this-deployment"))
        with pytest.raises(UntrustedPeerError, match="refused registration"):
            stranger.register_rank(record(0, agent="stranger"))
        peer = BootstrapClient(server.addr, auth=PeerAuth(SECRET))
        peer.register_rank(record(0))
        # a recorded registration cannot be replayed: its nonce was single-use
        nonce = http(server.addr, "GET", "/route/nonce")[1].split('"')[3]
        reg = PeerAuth(SECRET)
        data = json.dumps(record(1)).encode()
        headers = {"X-SGLang-PD-Auth": f"{nonce} {reg.sign('PUT', '/route', nonce, data)}"}
        assert http(server.addr, "PUT", "/route", data, headers)[0] == 200
        assert http(server.addr, "PUT", "/route", data, headers)[0] == 401
        assert http(server.addr, "GET", "/route")[0] == 401  # unauthenticated lookup
        with pytest.raises(UntrustedPeerError):
            stranger.parallel_info()
        assert peer.parallel_info()["ranks"] == [0, 1]
        # a peer refuses an answer that is not authenticated (a server without the secret)
        plain = CommonKVBootstrapServer()
        try:
            with pytest.raises(UntrustedPeerError, match="did not authenticate its answer"):
                BootstrapClient(plain.addr, auth=PeerAuth(SECRET)).parallel_info()
        finally:
            plain.close()
    finally:
        server.close()


def test_content_length_is_capped_before_reading():
    server = CommonKVBootstrapServer()
    try:
        host, port = server.addr.split(":")
        for length, code in ((10 ** 12, b"413"), (MAX_BODY_BYTES + 1, b"413"), (None, b"411"), ("x", b"400")):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                head = f"Content-Length: {length}\r\n" if length is not None else ""
                s.sendall(f"PUT /route HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + b"{}")
                s.settimeout(5)
                assert s.recv(64).split(b" ")[1] == code  # answered at once, without waiting for the body
        assert BootstrapClient(server.addr).parallel_info() is None  # still serving
    finally:
        server.close()


# ---- lookups --------------------------------------------------------------------------------

def test_a_black_hole_host_delays_only_its_own_rooms():
    """Rooms naming a host that accepts connections and never answers share one lookup at a
    time; a room naming a live bootstrap server bootstraps while those still hang."""
    hole = Listener()
    server = NixlKVBootstrapServer()
    prefill, _ = make(DisaggregationMode.PREFILL, server.addr)
    decode, _ = make(DisaggregationMode.DECODE)
    try:
        stuck = [NixlKVReceiver(decode, hole.addr, 100 + i) for i in range(6)]
        while not hole.accepted:
            time.sleep(0.01)
        NixlKVSender(prefill, server.addr, 7).init(1)
        good = NixlKVReceiver(decode, server.addr, 7)
        assert until(good.poll, {KVPoll.WaitingForInput, KVPoll.Failed}, timeout=60) == KVPoll.WaitingForInput
        # each attempt on the black hole waits out the client timeout; the good room did not wait
        # for the six rooms' attempts to end one after another (they share one in flight)
        assert hole.accepted <= 2, f"{hole.accepted} black-hole lookups ran before the good room's"
        assert {r.poll() for r in stuck} == {KVPoll.Bootstrapping}
        # the black hole's lookup ends by the client timeout and is tried again, the room waits on
        deadline = time.monotonic() + 15
        while not decode.decode_rooms[100].bootstrap_error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "timed out" in decode.decode_rooms[100].bootstrap_error
    finally:
        decode.close()
        prefill.close()
        server.close()
        hole.close()


# ---- authenticated control plane ------------------------------------------------------------

def test_transfer_with_a_secret_and_strangers_dropped(caplog):
    server = NixlKVBootstrapServer(secret=SECRET)
    prefill, ppool = make(DisaggregationMode.PREFILL, server.addr, secret=SECRET)
    decode, dpool = make(DisaggregationMode.DECODE, secret=SECRET)
    stranger = ControlChannel("127.0.0.1", "stranger", lambda m: None, lambda *a: None, 0.2, 3.0)
    try:
        ppool.buffers["k"].fill_(5.0)
        sender = NixlKVSender(prefill, server.addr, 9)
        sender.init(1, aux_index=1)
        recv = NixlKVReceiver(decode, server.addr, 9)
        assert until(recv.poll, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
        # a stranger reaching prefill's control port cannot register, claim or abort
        header = dict(ip="127.0.0.1", port=stranger.port, engine_rank=9, tp_rank=0, peer=decode.peer_info.to_json(),
                      kv_ptrs=[], kv_lens=[], aux_ptrs=[], aux_lens=[], state_ptrs=[], state_lens=[], staging_ptr=0,
                      staging_len=0)
        stranger.send_to("127.0.0.1", prefill.control.port, MsgKind.REGISTER, header, [b"x"])
        stranger.send_to("127.0.0.1", prefill.control.port, MsgKind.ABORT, {"room": 9, "reason": "stranger"})
        deadline = time.monotonic() + 5
        while caplog.text.count("is not authenticated by the shared secret") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert caplog.text.count("is not authenticated by the shared secret") >= 2
        assert "stranger" not in prefill.decode_peers
        recv.init([3], aux_index=2)
        assert until(sender.poll, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
        sender.send([1])
        assert until(lambda: (sender.poll(), recv.poll())[1], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert bool((dpool.buffers["k"][:, 3 * PAGE:4 * PAGE] == 5.0).all())
    finally:
        stranger.close()
        decode.close()
        prefill.close()
        server.close()


def test_decode_with_a_secret_never_registers_with_an_unauthenticated_server():
    rogue_server = NixlKVBootstrapServer()  # in the allow-list (loopback) but without the secret
    rogue, _ = make(DisaggregationMode.PREFILL, rogue_server.addr)  # its rank registers there
    decode, _ = make(DisaggregationMode.DECODE, secret=SECRET)
    try:
        recv = NixlKVReceiver(decode, rogue_server.addr, 5)
        assert until(recv.poll, {KVPoll.Failed}) == KVPoll.Failed
        assert "did not authenticate its answer" in str(recv.failure_exception())
        assert not decode.registered_prefill and not rogue.decode_peers
    finally:
        decode.close()
        rogue.close()
        rogue_server.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
