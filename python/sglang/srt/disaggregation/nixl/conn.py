"""NIXL PD transfer: upstream's names of this module. ``NixlKVSender`` (prefill) and
``NixlKVReceiver`` (decode) are the shared room ends (``common/conn.py``, whose docstring gives
the call sequence) on a ``NixlKVManager`` (``manager.py``: the shared manager over NIXL);
``NixlKVBootstrapServer`` is the shared bootstrap server. Also importable here, from where they
live: ``TransferStatus`` (``common/status.py``), ``KVRoute`` (``common/kv_routes.py``) and the
backend helpers ``load_nixl_agent_classes`` / ``parse_nixl_backend_params`` /
``validate_nixl_backend_available`` (``agent.py``, which makes the manager's agent).
"""

from __future__ import annotations

from sglang.srt.disaggregation.common.bootstrap import CommonKVBootstrapServer
from sglang.srt.disaggregation.common.conn import PDKVReceiver, PDKVSender
from sglang.srt.disaggregation.common.kv_routes import KVRoute
from sglang.srt.disaggregation.common.status import TransferStatus
from sglang.srt.disaggregation.nixl.agent import (
    load_nixl_agent_classes,
    parse_nixl_backend_params,
    validate_nixl_backend_available,
)
from sglang.srt.disaggregation.nixl.manager import NixlKVManager

__all__ = [
    "KVRoute",
    "NixlKVBootstrapServer",
    "NixlKVManager",
    "NixlKVReceiver",
    "NixlKVSender",
    "TransferStatus",
    "load_nixl_agent_classes",
    "parse_nixl_backend_params",
    "validate_nixl_backend_available",
]


class NixlKVBootstrapServer(CommonKVBootstrapServer):
    """The HTTP bootstrap server a prefill deployment hosts (one per prefill cluster)."""


class NixlKVSender(PDKVSender):
    """Prefill side of one room, on a NixlKVManager."""


class NixlKVReceiver(PDKVReceiver):
    """Decode side of one room, on a NixlKVManager."""
