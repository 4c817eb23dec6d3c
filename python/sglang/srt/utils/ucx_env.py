"""UCX settings for processes that make NIXL agents.

On a host with Debian's ``libibverbs1`` installed (Mooncake's wheel needs it) but no RDMA
device, UCX loads its InfiniBand transport module anyway, and NIXL 1.5.1's UCX backend then
segfaults when the process exits (even a bare agent that moved nothing). Without an RDMA device
that module has nothing to drive, so ``ensure_ucx_env`` leaves it out (``UCX_MODULES=^ib``)
before UCX reads its configuration. A host with RDMA devices keeps every module, and a
``UCX_MODULES`` the user set is never changed.
"""

from __future__ import annotations

import os

RDMA_DEVICES_DIR = "/sys/class/infiniband"
NO_IB_MODULES = "^ib"


def has_rdma_device(devices_dir: str = RDMA_DEVICES_DIR) -> bool:
    try:
        return bool(os.listdir(devices_dir))
    except OSError:
        return False


def ensure_ucx_env(devices_dir: str = RDMA_DEVICES_DIR) -> str | None:
    """Set ``UCX_MODULES=^ib`` when it is unset and the host has no RDMA device; return the
    value UCX will read (None: unset, UCX's default)."""
    if "UCX_MODULES" not in os.environ and not has_rdma_device(devices_dir):
        os.environ["UCX_MODULES"] = NO_IB_MODULES
    return os.environ.get("UCX_MODULES")
