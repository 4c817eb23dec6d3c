"""Host buffers: page-aligned anonymous mmap memory, faulted in up front, pinned when CUDA is present.

``torch.empty`` only guarantees 64-byte alignment; O_DIRECT and zero-copy registration need
4096, which mmap gives. Sizes are checked against MemAvailable up front because mmap is lazy and
an over-sized pool would otherwise fail much later, at first touch.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Fault every page in when the buffer is made, as pinning does on CUDA hosts: a lazily mapped pool
# pays a page fault on the first write to each 4 KiB, inside a transfer (a cold 3072-token backup
# took 870 us against 240 us warm, issue 9). The pool's size was checked against MemAvailable.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_RESERVE_ENV = "SGLANG_HICACHE_HOST_MEM_RESERVE_GB"


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_reserve_bytes(total_available: int) -> int:
    """Memory kept free for the rest of the process: env override, else min(10 GiB, 20%)."""
    env = os.environ.get(_RESERVE_ENV)
    if env is not None:
        return int(float(env) * GiB)
    return min(10 * GiB, total_available // 5)


def check_host_memory(nbytes: int, what: str) -> None:
    """Raise ValueError when ``nbytes`` would not fit in host memory (keeping the reserve)."""
    avail = available_host_bytes()
    reserve = host_memory_reserve_bytes(avail)
    if nbytes > avail - reserve:
        raise ValueError(
            f"{what} needs {nbytes / GiB:.2f} GiB of host memory but only {avail / GiB:.2f} GiB is available "
            f"and {reserve / GiB:.2f} GiB is kept in reserve ({_RESERVE_ENV}); lower --hicache-ratio or "
            f"--hicache-size"
        )


class HostBuffer:
    """``nbytes`` of page-aligned host memory as a uint8 tensor, optionally pinned for CUDA."""

    def __init__(self, nbytes: int, pin_memory: bool):
        self.nbytes = nbytes
        self._mmap = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(
            0, dtype=torch.uint8
        )
        self.pinned = False
        if pin_memory and nbytes:
            self._pin()

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with error {int(err)}")
        self.pinned = True

    def release(self) -> None:
        """Unregister pinned memory (idempotent); the mapping goes when the last tensor does."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
