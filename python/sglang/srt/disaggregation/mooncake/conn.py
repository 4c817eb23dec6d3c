"""Mooncake PD transfer: upstream's names over our PD layer. ``MooncakeKVManager`` is the shared
``PDKVManager`` (``common/manager.py``: rooms, staging, head slicing for heterogeneous TP,
timeouts, heartbeats) with ``MooncakeTransport`` (``transport.py``) moving the bytes; sender,
receiver and bootstrap server are the shared ones (``common/conn.py``), used exactly as the NIXL
classes.
"""

from __future__ import annotations

from sglang.srt.disaggregation.common.bootstrap import CommonKVBootstrapServer
from sglang.srt.disaggregation.common.conn import PDKVReceiver, PDKVSender
from sglang.srt.disaggregation.common.manager import PDKVManager
from sglang.srt.disaggregation.common.messages import MsgKind
from sglang.srt.disaggregation.mooncake.transport import MooncakeTransport

__all__ = ["MooncakeKVBootstrapServer", "MooncakeKVManager", "MooncakeKVReceiver", "MooncakeKVSender"]


class MooncakeKVManager(PDKVManager):
    """PDKVManager over Mooncake; tags travel as NIXL-format NOTIF control messages."""

    def _make_transport(self) -> MooncakeTransport:
        return MooncakeTransport(self.agent_name, self.config, self._send_notif_message)

    def _send_notif_message(self, peer: str, tag: bytes) -> bool:
        return self.control.send(peer, MsgKind.NOTIF, {"tag": tag.decode()})


class MooncakeKVSender(PDKVSender):
    """Prefill side of one room (the shared sender, on a MooncakeKVManager)."""


class MooncakeKVReceiver(PDKVReceiver):
    """Decode side of one room (the shared receiver, on a MooncakeKVManager)."""


class MooncakeKVBootstrapServer(CommonKVBootstrapServer):
    """The HTTP bootstrap server a prefill deployment hosts (the shared one)."""
