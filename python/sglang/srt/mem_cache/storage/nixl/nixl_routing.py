"""Where a NIXL FILE object lives: ``<base_dirs[disk]>/<bucket>/<name>``.

An object routes by its *page group*: the part of its name before the first ``.`` (the whole
name when it has none). Every object of one key starts with that key's group (``PoolCodec``,
grouped names), so all of them, of every pool, share one directory of one disk and are evicted
together (``capacity.py``). The route is a stable hash of the group, so a store reopened with the
same directories finds every object again, in any process.
"""

from __future__ import annotations

import hashlib

from sglang.srt.mem_cache.storage.keys import GROUP_SEPARATOR

BUCKET_HEX_CHARS = 2  # 256 bucket directories per disk
NUM_BUCKETS = 1 << (4 * BUCKET_HEX_CHARS)


def routing_group(name: str) -> str:
    """The part of ``name`` that decides its directory (its page group)."""
    return name.partition(GROUP_SEPARATOR)[0]


def stable_key_hash(key: str) -> int:
    """A 64-bit hash of ``key``'s page group, the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(routing_group(key).encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


def route_key(key: str, num_disks: int) -> tuple[int, str]:
    """(disk index in [0, num_disks), bucket directory name of BUCKET_HEX_CHARS hex digits) of
    ``key``. ValueError when ``num_disks`` < 1."""
    if num_disks < 1:
        raise ValueError(f"num_disks must be >= 1, got {num_disks}")
    h = stable_key_hash(key)
    return (h >> 32) % num_disks, format(h % NUM_BUCKETS, f"0{BUCKET_HEX_CHARS}x")


def route_disk(key: str, num_disks: int) -> int:
    """The disk index of ``key`` (``route_key``'s first part)."""
    return route_key(key, num_disks)[0]
