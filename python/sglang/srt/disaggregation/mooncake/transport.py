"""MooncakeTransport: ``KVTransport`` (``base/transport.py``) over Mooncake's transfer engine.

The engine starts peer-to-peer (metadata ``P2PHANDSHAKE``: no metadata server) on this rank's
host; its session ``host:rpc_port`` is the metadata a decode rank sends in REGISTER. Protocol
``TransferConfig.mooncake_protocol`` (default: rdma where the host has an RDMA device, else tcp)
on ``mooncake_device``.

Mooncake has no notifications, so a WRITE and its tag are two steps on a worker thread: the
batch is written synchronously (``batch_transfer_sync_write``, which returns once every byte
landed or failed), then the tag goes to the peer as a NOTIF control message through ``notify``
(the manager's control channel), so decode files it exactly as a NIXL notification. A write
that failed, or whose tag could not be sent, is "ERR" and its tag is never sent; a handle
released while its write runs is abandoned (Mooncake cannot cancel it), and its tag is never
sent either. A silent peer holds a write for at most about ``transfer_timeout_s``
(``bound_tcp_timeouts``); the manager's own timeouts and heartbeats fail the room earlier.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from sglang.srt.disaggregation.base.conn import KVTransferError, TransferConfig
from sglang.srt.disaggregation.base.transport import KVTransport
from sglang.srt.disaggregation.common.descriptors import Descs
from sglang.srt.utils.mooncake_env import bound_tcp_timeouts
from sglang.srt.utils.ucx_env import has_rdma_device

logger = logging.getLogger(__name__)

ENV_MOONCAKE_PROTOCOL = "MOONCAKE_PROTOCOL"  # upstream's name
WRITE_THREADS = 4
MAX_BATCH = 1024  # entries per batch_transfer_sync_write call


def load_transfer_engine():
    """Mooncake's ``TransferEngine`` class; ImportError with install guidance when missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "the mooncake transfer backend needs Mooncake's wheel (pip install 'sglang[mooncake]', i.e. "
            "mooncake-transfer-engine, or the -non-cuda wheel on hosts without CUDA) and Debian's "
            f"libibverbs1 and librdmacm1: {exc}"
        ) from exc
    return TransferEngine


def default_protocol() -> str:
    return "rdma" if has_rdma_device() else "tcp"


class _Write:
    """One posted WRITE: its future (the state string) and whether it was released."""

    def __init__(self, peer: str, tag: bytes):
        self.peer, self.tag = peer, tag
        self.future: Future | None = None
        self.released = False
        self.lock = threading.Lock()


class MooncakeTransport(KVTransport):
    backend = "mooncake"

    def __init__(self, name: str, config: TransferConfig, notify: Callable[[str, bytes], bool]):
        """``notify(peer, tag)``: deliver a tag to a peer (False when it could not be sent)."""
        TransferEngine = load_transfer_engine()
        self.name, self._notify = name, notify
        self.protocol = config.mooncake_protocol or default_protocol()
        bound_tcp_timeouts(config.transfer_timeout_s)  # read when the engine's transport starts
        self.engine = TransferEngine()
        code = self.engine.initialize(config.host, "P2PHANDSHAKE", self.protocol, config.mooncake_device)
        if code != 0:
            raise ValueError(f"Mooncake transfer engine failed to start (code {code}) on {config.host} with "
                             f"protocol {self.protocol!r}, device {config.mooncake_device!r}")
        self.session = f"{config.host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._peers: dict[str, str] = {}  # peer name -> session
        self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix=f"{name}-mc-write")
        logger.info("Mooncake transport %s: session %s, protocol %s", name, self.session, self.protocol)

    def register_memory(self, regions: list[tuple[int, int]]) -> None:
        regions = [(p, n) for p, n in regions if n > 0]
        if not regions:
            return
        code = self.engine.batch_register_memory([p for p, _ in regions], [n for _, n in regions])
        if code != 0:
            raise ValueError(f"Mooncake could not register {len(regions)} buffers (code {code})")
        self._registered = [p for p, _ in regions]

    def local_metadata(self) -> bytes:
        return json.dumps({"backend": self.backend, "session": self.session}).encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        try:
            info = json.loads(metadata)
            session = info["session"]
            host, _, port = session.rpartition(":")
            ok = info.get("backend") == self.backend and host and 0 < int(port) < 65536
        except (ValueError, TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            raise ValueError(f"bad Mooncake session metadata {metadata[:80]!r} (is the peer using another "
                             "--disaggregation-transfer-backend?)")
        self._peers[name] = session

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def post_write(self, peer: str, descs: Descs, tag: bytes) -> _Write:
        session = self._peers.get(peer)
        if session is None:
            raise KVTransferError(f"Mooncake could not start {tag!r} to {peer}: not a registered peer")
        write = _Write(peer, tag)
        src, dst, lens = (descs.src[:, 0].tolist(), descs.dst[:, 0].tolist(), descs.src[:, 1].tolist())
        try:
            write.future = self._pool.submit(self._run, write, session, src, dst, lens)
        except RuntimeError as exc:  # shut down
            raise KVTransferError(f"Mooncake could not start {tag!r} to {peer}: {exc}") from exc
        return write

    def _run(self, write: _Write, session: str, src: list[int], dst: list[int], lens: list[int]) -> str:
        for i in range(0, len(src), MAX_BATCH):
            with write.lock:
                if write.released:
                    return "ERR (released)"
            end = i + MAX_BATCH
            code = self.engine.batch_transfer_sync_write(session, src[i:end], dst[i:end], lens[i:end])
            if code < 0:
                logger.warning("%s: Mooncake write %r to %s failed (code %d)", self.name, write.tag, write.peer, code)
                return f"ERR (Mooncake code {code})"
        with write.lock:
            if write.released:
                return "ERR (released)"
            if write.tag and not self._notify(write.peer, write.tag):
                return "ERR (notification not sent)"
        return "DONE"

    def send_notif(self, peer: str, tag: bytes) -> None:
        if not self._notify(peer, tag):
            raise KVTransferError(f"Mooncake could not send {tag!r} to {peer}: peer gone or its queue full")

    def check(self, handle: _Write) -> str:
        if not handle.future.done():
            return "PROC"
        try:
            return "DONE" if handle.future.result() == "DONE" else "ERR"
        except Exception as exc:
            logger.warning("%s: Mooncake write %r to %s raised %r", self.name, handle.tag, handle.peer, exc)
            return "ERR"

    def release(self, handle: _Write) -> None:
        with handle.lock:
            handle.released = True

    def drain_notifs(self) -> dict[str, list[bytes]]:
        return {}  # tags arrive as NOTIF control messages

    def close(self) -> None:
        """Wait for running writes (each bounded by Mooncake's TCP timeouts), then deregister."""
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._registered:
                self.engine.batch_unregister_memory(self._registered)
                self._registered = []
        except Exception as exc:
            logger.warning("%s: closing the Mooncake transport failed: %s", self.name, exc)
        self.engine = None
