"""Mooncake transfer-engine settings shared by its users (the HiCache Mooncake store and the PD
Mooncake transport): both read Mooncake's TCP timeouts from the environment when the engine
starts, so they are set here, before that.
"""

from __future__ import annotations

import math
import os

TCP_TIMEOUT_ENVS = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


def bound_tcp_timeouts(transfer_timeout_s: float) -> None:
    """Set Mooncake's TCP progress/status timeouts (read when its transport starts) so that a
    transfer from a silent peer fails within about ``transfer_timeout_s``; values already in the
    environment win."""
    per_phase = str(max(1, math.ceil(transfer_timeout_s / 3)))
    for name in TCP_TIMEOUT_ENVS:
        os.environ.setdefault(name, per_phase)
