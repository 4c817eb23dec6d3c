"""HiCache auto-sizing: the default ``--hicache-ratio`` lowered until the host pools fit.

When neither ``--hicache-ratio`` nor ``--hicache-size`` is given (upstream's rule), the host pools
of all ranks on this machine may use ``--hicache-host-memory-fraction`` of the host memory that is
available: ``MemAvailable`` from ``/proc/meminfo``, bounded by what the process's memory cgroups
still allow (v2 ``memory.max`` / ``memory.high``, v1 ``memory.limit_in_bytes``, at every level up
to the mount root, reclaimable file cache counted as free), less the reserve that every host pool
check keeps (``pool_host.memory.host_memory_reserve_bytes``). That budget is split over the ranks
on this host; the ratio is the smaller of the requested one and what the budget buys for the
device pools' bytes (5% kept for page rounding and staging), agreed with MIN over the TP ranks
before any host pool is built. Only ever lowered; ValueError when nothing is left.

Every reader takes the proc root (``/proc`` by default, ``PROC_ROOT``) so a test can hand it a
fake ``meminfo``, ``self/cgroup`` and ``self/mountinfo``, the latter naming fake cgroup mounts.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path, PurePosixPath
from typing import Callable

from sglang.srt.mem_cache.pool_host.memory import GiB, host_memory_reserve_bytes

logger = logging.getLogger(__name__)

PROC_ROOT = Path("/proc")
# Page rounding, allocator metadata and staging buffers are not in the device pools' byte counts.
ALLOCATION_SLACK_FRACTION = 0.05
# The ratio travels through the integer MIN collective in millionths (floored: never rounded up).
RATIO_SCALE = 1_000_000
_RANK_FAILED = -1

# cgroup version (mountinfo filesystem type) -> (limit files, usage file, reclaimable page cache keys)
_CGROUP_FILES = {
    "cgroup2": (("memory.max", "memory.high"), "memory.current", ("active_file", "inactive_file")),
    # v1's unprefixed stat counters leave out descendants, which its usage includes
    "cgroup": (("memory.limit_in_bytes",), "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
}


def mem_available_bytes(meminfo: str) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes; ValueError when it has none."""
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    if match is None:
        raise ValueError("/proc/meminfo has no MemAvailable line")
    return int(match.group(1)) * 1024


def _memberships(cgroup: str) -> dict[str, PurePosixPath]:
    """``/proc/self/cgroup`` -> {"cgroup2": path} for the unified line, {"cgroup": path} for v1 memory."""
    out = {}
    for line in cgroup.splitlines():
        if not line.strip():
            continue
        _, controllers, path = line.split(":", 2)
        if not controllers:
            out["cgroup2"] = PurePosixPath(path)
        elif "memory" in controllers.split(","):
            out["cgroup"] = PurePosixPath(path)
    return out


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as three octal digits."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dirs(memberships: dict, mountinfo: str):
    """Yield (version, mount point, this process's cgroup directory) for each memory hierarchy."""
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        if not sep:
            continue
        fstype, _source, options = (after.split() + ["", ""])[:3]
        if fstype not in memberships or (fstype == "cgroup" and "memory" not in options.split(",")):
            continue
        fields = before.split()
        root, mount = PurePosixPath(_unescape(fields[3])), Path(_unescape(fields[4]))
        member = memberships[fstype]
        if member.is_relative_to(root):
            relative = member.relative_to(root)
        else:  # a cgroup namespace: membership is relative to its root, mountinfo shows the host path
            relative = member.relative_to("/")
        if ".." in relative.parts:
            raise ValueError(f"cannot resolve the memory cgroup path {member}")
        yield fstype, mount, mount / relative


def _level_headroom(directory: Path, version: str) -> int | None:
    """Bytes the limits of one cgroup level still allow (None: no limit there)."""
    limit_names, usage_name, cache_keys = _CGROUP_FILES[version]
    headroom, usage = None, None
    for name in limit_names:
        try:
            value = (directory / name).read_text().strip()
        except FileNotFoundError:  # a hierarchy root has no limit files
            continue
        if value == "max":
            continue
        if usage is None:  # a known limit with an unreadable usage is an error, not "no limit"
            stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines() if line)
            page_cache = sum(int(stat.get(key, 0)) for key in cache_keys)
            usage = max(0, int((directory / usage_name).read_text()) - page_cache)
        remaining = max(0, int(value) - usage)
        headroom = remaining if headroom is None else min(headroom, remaining)
    return headroom


def cgroup_headroom_bytes(proc_root: Path | None = None) -> int | None:
    """Bytes this process's memory cgroups still allow (the tightest level of every hierarchy).

    None when no limit is visible (no ``self/cgroup``: not Linux; or no level sets one).
    ValueError when the process is in a memory cgroup that no mounted hierarchy shows.
    """
    proc_root = PROC_ROOT if proc_root is None else proc_root
    try:
        cgroup = (proc_root / "self/cgroup").read_text()
        mountinfo = (proc_root / "self/mountinfo").read_text()
    except FileNotFoundError:
        return None
    memberships = _memberships(cgroup)
    headroom, resolved = None, False
    for version, mount, directory in _cgroup_dirs(memberships, mountinfo):
        if not directory.is_dir():
            continue
        resolved = True
        while True:
            level = _level_headroom(directory, version)
            if level is not None:
                headroom = level if headroom is None else min(headroom, level)
            if directory == mount:
                break
            directory = directory.parent
    if memberships and not resolved:
        raise ValueError("cannot find this process's memory cgroup among the mounted cgroup filesystems")
    return headroom


def host_memory_budget_bytes(fraction: float, ranks_per_host: int, proc_root: Path | None = None) -> int:
    """Host bytes one rank's HiCache pools may use: ``fraction`` of (available - reserve) / ranks.

    Available is MemAvailable bounded by the cgroup headroom. Never negative.
    """
    proc_root = PROC_ROOT if proc_root is None else proc_root
    available = mem_available_bytes((proc_root / "meminfo").read_text())
    headroom = cgroup_headroom_bytes(proc_root)
    if headroom is not None:
        available = min(available, headroom)
    free = max(0, available - host_memory_reserve_bytes(available))
    return int(free // max(1, ranks_per_host) * fraction)


def fitting_ratio(requested_ratio: float, device_bytes: int, budget_bytes: int) -> float:
    """The requested ratio, lowered so ``ratio x device_bytes`` (plus slack) fits ``budget_bytes``."""
    if device_bytes <= 0:  # nothing to mirror (a logical anchor only): any ratio fits
        return requested_ratio
    return min(requested_ratio, budget_bytes * (1 - ALLOCATION_SLACK_FRACTION) / device_bytes)


def auto_size_hicache(requested_ratio: float, fraction: float, device_bytes: int, *, ranks_per_host: int,
                      agree_min: Callable[[list[int]], list[int]] | None = None, tp_rank: int = 0,
                      proc_root: Path | None = None) -> float:
    """The host-to-device ratio every rank builds its host pools with (<= ``requested_ratio``).

    ``device_bytes``: this rank's device pools that get host mirrors, in bytes. ``agree_min``:
    the TP ranks' MIN (``TPAgreement.min``; None: one rank); every rank calls it exactly once,
    a rank that failed to read its memory contributing a marker, so no rank waits alone. Logs the
    decision at INFO on ``tp_rank`` 0. ValueError when no host memory is left for HiCache.
    """
    error, budget, local = None, 0, 0.0
    try:
        budget = host_memory_budget_bytes(fraction, ranks_per_host, proc_root)
        local = fitting_ratio(requested_ratio, device_bytes, budget)
    except (OSError, ValueError) as exc:
        error = exc
    scaled = _RANK_FAILED if error is not None else int(local * RATIO_SCALE)
    agreed = agree_min([scaled])[0] if agree_min is not None else scaled
    if error is not None:
        raise ValueError(f"HiCache auto-sizing (--hicache-host-memory-fraction) cannot read the host memory: "
                         f"{error}; set --hicache-ratio or --hicache-size explicitly") from error
    if agreed == _RANK_FAILED:
        raise ValueError("HiCache auto-sizing failed on another TP rank (see its error); set --hicache-ratio or "
                         "--hicache-size explicitly")
    ratio = agreed / RATIO_SCALE
    if ratio <= 0:
        raise ValueError(f"no host memory is left for HiCache after the reserve (--hicache-host-memory-fraction "
                         f"{fraction}: {budget / GiB:.2f} GiB per rank on this host); free memory, raise the "
                         "fraction, or set --hicache-ratio or --hicache-size explicitly")
    if tp_rank == 0:
        logger.info("HiCache auto-sizing: ratio %.3f -> %.3f; %.2f GiB host memory per rank (fraction %.2f, %d "
                    "ranks on this host), host pools %.2f GiB per rank", requested_ratio, ratio, budget / GiB,
                    fraction, ranks_per_host, device_bytes * ratio / GiB)
    return ratio
