"""NixlKVManager: the PD manager (``common/manager.py``) over NIXL (``nixl/transport.py``)."""

from __future__ import annotations

from sglang.srt.disaggregation.common.kv_routes import KVRoute
from sglang.srt.disaggregation.common.manager import PDKVManager
from sglang.srt.disaggregation.nixl.transport import NixlTransport

__all__ = ["KVRoute", "NixlKVManager", "PDKVManager"]


class NixlKVManager(PDKVManager):
    """PDKVManager over NIXL (``TransferConfig.nixl_backend``, UCX by default)."""

    def _make_transport(self) -> NixlTransport:
        return NixlTransport(self.agent_name, self.config)

    @property
    def agent(self):
        """The NIXL agent (None once closed)."""
        return self.transport.agent
