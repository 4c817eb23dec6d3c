"""Control channel of one rank: a ZMQ PULL socket in, PUSH sockets out, and peer liveness.

Two daemon threads: the receiver decodes every message (a malformed one is logged and dropped)
and hands it to ``on_message``; the heartbeat thread sends HEARTBEAT to every tracked peer each
interval, calls ``on_peer_dead(name, reason)`` once for a peer silent longer than the timeout,
then ``on_tick()`` (the owner's background progress).
With a shared secret (``auth``, a ``PeerAuth``) every message out carries its HMAC and a
message in without a valid one is dropped unread: a stranger who reaches the port can neither
register, request, claim, abort nor keep a dead peer alive.
Any message from a tracked peer counts as a sign of life. Sends never block: a message to a
peer whose queue is full is dropped (the heartbeat timeout then decides).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from sglang.srt.disaggregation.common.messages import (
    MalformedMessage,
    Message,
    MsgKind,
    decode_message,
    encode_message,
)

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    ip: str
    port: int
    last_seen: float


class ControlChannel:
    """Bound to ``host`` on a free port (``.port``). Thread-safe ``send``/``add_peer``."""

    def __init__(self, host: str, agent_name: str, on_message: Callable[[Message], None],
                 on_peer_dead: Callable[[str, str], None], heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 on_tick: Callable[[], None] | None = None, auth=None):
        self.host, self.agent_name, self._auth = host, agent_name, auth
        self._on_message, self._on_peer_dead, self._on_tick = on_message, on_peer_dead, on_tick
        self._interval, self._timeout = heartbeat_interval_s, heartbeat_timeout_s
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._push: dict[tuple[str, int], zmq.Socket] = {}
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._recv_loop, name=f"pd-ctl-recv-{agent_name}", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name=f"pd-ctl-hb-{agent_name}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def add_peer(self, name: str, ip: str, port: int) -> None:
        """Track ``name`` for liveness from now on (a known peer keeps its timer)."""
        with self._lock:
            if name not in self._peers:
                self._peers[name] = _Peer(ip, port, time.monotonic())

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)

    def is_alive(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    def send(self, name: str, kind: MsgKind, header: dict, blobs=()) -> bool:
        """Send to a tracked peer; False when it is unknown (dead) or its queue is full."""
        with self._lock:
            peer = self._peers.get(name)
        return peer is not None and self.send_to(peer.ip, peer.port, kind, header, blobs)

    def send_to(self, ip: str, port: int, kind: MsgKind, header: dict, blobs=()) -> bool:
        """Send to an endpoint; False when the message was dropped."""
        frames = encode_message(kind, {"agent_name": self.agent_name, **header}, blobs, self._auth)
        with self._lock:
            if self._stop.is_set():
                return False
            sock = self._push.get((ip, port))
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(f"tcp://{ip}:{port}")
                self._push[(ip, port)] = sock
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                logger.debug("control message %s to %s:%d dropped: queue full", kind.value, ip, port)
                return False

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("control socket receive failed")
                continue
            try:
                msg = decode_message(frames, self._auth)
            except MalformedMessage as exc:
                logger.warning("dropped malformed control message: %s", exc)
                continue
            with self._lock:
                peer = self._peers.get(msg.header["agent_name"])
                if peer is not None:
                    peer.last_seen = time.monotonic()
            if msg.kind is MsgKind.HEARTBEAT:
                continue
            try:
                self._on_message(msg)
            except Exception:  # a bad message must never stop the channel
                logger.exception("handling %s from %s failed; message dropped", msg.kind.value,
                                 msg.header["agent_name"])

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            with self._lock:
                peers = dict(self._peers)
                dead = [n for n, p in peers.items() if now - p.last_seen > self._timeout]
                for name in dead:
                    del self._peers[name]
            for name, peer in peers.items():
                if name in dead:
                    reason = f"peer {name} at {peer.ip}:{peer.port} silent for {now - peer.last_seen:.1f}s"
                    logger.warning("%s; failing its requests", reason)
                    try:
                        self._on_peer_dead(name, reason)
                    except Exception:
                        logger.exception("peer-death handler for %s failed", name)
                else:
                    self.send_to(peer.ip, peer.port, MsgKind.HEARTBEAT, {"ip": self.host, "port": self.port})
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:
                    logger.exception("heartbeat tick failed")

    def close(self) -> None:
        with self._lock:
            self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            for sock in self._push.values():
                sock.close(linger=0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()
