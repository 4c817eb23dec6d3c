"""NixlTransport: the NIXL implementation of ``KVTransport`` (``base/transport.py``).

A WRITE carries its notification tag (NIXL delivers it after the bytes); peers exchange NIXL
agent metadata; ``drain_notifs`` reads NIXL's notifications, which also progresses the UCX
worker (prefill calls it for that alone: a bare notification without a handle needs it).
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVTransferError, TransferConfig
from sglang.srt.disaggregation.base.transport import KVTransport
from sglang.srt.disaggregation.common.descriptors import Descs
from sglang.srt.disaggregation.nixl.agent import create_pd_agent

logger = logging.getLogger(__name__)


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(self, name: str, config: TransferConfig):
        self.name = name
        self.agent = create_pd_agent(name, config)
        self._reg_descs = None

    def register_memory(self, regions: list[tuple[int, int]]) -> None:
        self._reg_descs = self.agent.register_memory([(int(p), int(n), 0, "") for p, n in regions], "DRAM")

    def local_metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, name: str, metadata: bytes) -> None:
        try:
            self.agent.add_remote_agent(metadata)
        except Exception as exc:  # the binding raises bare nixl errors on bad metadata
            raise ValueError(f"bad NIXL agent metadata: {exc}") from None

    def remove_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            logger.debug("removing remote agent %s: %s", name, exc)

    def post_write(self, peer: str, descs: Descs, tag: bytes) -> object:
        try:
            src = self.agent.get_xfer_descs(descs.src, "DRAM")
            dst = self.agent.get_xfer_descs(descs.dst, "DRAM")
            handle = self.agent.initialize_xfer("WRITE", src, dst, peer, tag)
        except Exception as exc:  # the binding raises bare nixl errors
            raise KVTransferError(f"NIXL could not start {tag!r} to {peer}: {exc!r}") from exc
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError when the peer died
            state = f"ERR ({exc!r})"
        if state.startswith("ERR"):
            try:
                self.release(handle)
            except Exception as exc:
                logger.warning("%s: releasing transfer handle failed: %s", self.name, exc)
            raise KVTransferError(f"NIXL failed to post {tag!r} to {peer}: {state}")
        return handle

    def send_notif(self, peer: str, tag: bytes) -> None:
        try:
            self.agent.send_notif(peer, tag)
        except Exception as exc:
            raise KVTransferError(f"NIXL could not send {tag!r} to {peer}: {exc!r}") from exc

    def check(self, handle) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        self.agent.release_xfer_handle(handle)

    def drain_notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def close(self) -> None:
        if self._reg_descs is not None:
            try:
                self.agent.deregister_memory(self._reg_descs)
            except Exception as exc:
                logger.warning("%s: deregistering memory failed: %s", self.name, exc)
            self._reg_descs = None
        self.agent = None  # drops the NIXL agent and its UCX workers
