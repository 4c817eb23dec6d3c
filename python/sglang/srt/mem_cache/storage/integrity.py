"""Integrity trailer of a stored object: ``payload || trailer``.

The trailer is zero padding followed by a 48-byte header, padded up to the backend's trailer
size (64 bytes for the file backend; 4096 for NIXL so that O_DIRECT can write it). The header
sits at the very end, so any short read misses it: a reader poisons the header bytes of its
buffer first (:func:`poison_trailer`) and a short read cannot pass for a whole object, even when
the buffer held a valid trailer before or the cut falls in the zero padding.

The header holds a magic, a version, the checksum algorithm, the payload length, the payload
checksum, the *page digest* (a hash of the checksums of every object of the page, so a page
whose objects come from two different writes -- two concurrent writers of one key, K from one
and V from the other -- is detected), a 16-byte tag of the object's name (a file renamed or
copied under another key fails) and a CRC-32 of the header itself. Every byte of the trailer is
checked, padding included. The payload checksum is XXH3-64 when the ``xxhash`` package is
installed and CRC-32 otherwise. Verifying a page costs a pass over its bytes beside the copy
that loads it, so the hash speed bounds L3 throughput: xxhash >= 4.1 picks AVX2 / AVX-512 at
run time (about 60 GB/s on a Zen 4 core, in cache), 4.0 is built for SSE2 only (about 20-30
GB/s), zlib's CRC-32 manages 2-4 GB/s. A reader follows the algorithm its trailer names; an
object whose algorithm it cannot compute (XXH3 without ``xxhash``) fails verification like a
corrupt one and is rewritten by the next backup, so install ``xxhash`` everywhere that shares
one L3.

These are integrity checks against torn writes and media or copy faults, not authentication.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from enum import IntEnum
from typing import Sequence

MAGIC = b"SGLHCL3\x00"
VERSION = 1
# magic, version, algorithm, payload_len, checksum, page digest, name tag
_HEADER = struct.Struct("<8sHHQQQ16s")
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 56
MIN_TRAILER_BYTES = 64

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised where xxhash is absent
    xxhash = None


class Checksum(IntEnum):
    CRC32 = 1
    XXH3_64 = 2


def available(algo: Checksum) -> bool:
    return algo is Checksum.CRC32 or xxhash is not None


_ALGOS = {int(a): a for a in Checksum}
DEFAULT_CHECKSUM = Checksum.XXH3_64 if xxhash is not None else Checksum.CRC32


def payload_checksum(pieces: Sequence, algo: Checksum = DEFAULT_CHECKSUM) -> int:
    """Checksum of the concatenation of ``pieces`` (buffer-protocol objects, e.g. numpy views)."""
    if algo is Checksum.XXH3_64:
        if len(pieces) == 1:
            return xxhash.xxh3_64_intdigest(pieces[0])
        h = xxhash.xxh3_64()
        for piece in pieces:
            h.update(piece)
        return h.intdigest()
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


def name_tag(name: str) -> bytes:
    return hashlib.sha256(name.encode("utf-8")).digest()[:16]


_CHECKSUMS = [struct.Struct(f"<{n}Q") for n in range(9)]


def page_digest(checksums: list[int]) -> int:
    """Digest binding the objects of one page write together (order = object order)."""
    n = len(checksums)
    packed = (_CHECKSUMS[n] if n < len(_CHECKSUMS) else struct.Struct(f"<{n}Q")).pack(*checksums)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def pack_trailer(name: str, payload_len: int, checksum: int, digest: int, trailer_bytes: int,
                 algo: Checksum = DEFAULT_CHECKSUM) -> bytes:
    """The trailer of a ``payload_len``-byte payload with ``checksum``, written as part of the
    page whose :func:`page_digest` is ``digest``, stored as ``name``."""
    if trailer_bytes < MIN_TRAILER_BYTES:
        raise ValueError(f"trailer_bytes must be >= {MIN_TRAILER_BYTES}, got {trailer_bytes}")
    head = _HEADER.pack(MAGIC, VERSION, int(algo), payload_len, checksum, digest, name_tag(name))
    head += _HEADER_CRC.pack(zlib.crc32(head))
    return bytes(trailer_bytes - len(head)) + head


_ZERO_PADDING: dict[int, bytes] = {}
_SUPPORTED = {int(a): a for a in Checksum if available(a)}
_HEADER_AND_CRC = struct.Struct(_HEADER.format + "I")


def read_trailer(trailer, name: str, pieces: Sequence, payload_len: int | None = None) -> tuple[int, int] | None:
    """(payload checksum, page digest) when ``trailer`` (bytes-like) is exactly the trailer of
    ``pieces`` (``payload_len`` bytes in all, computed when not given) stored as ``name``;
    None otherwise. The payload is hashed last, after every cheap check passed."""
    raw = trailer if isinstance(trailer, (bytes, bytearray)) else memoryview(trailer).cast("B")
    pad = len(raw) - HEADER_BYTES
    if pad < MIN_TRAILER_BYTES - HEADER_BYTES:
        return None
    magic, version, algo, stored_len, checksum, digest, tag, crc = _HEADER_AND_CRC.unpack_from(raw, pad)
    if magic != MAGIC or version != VERSION or algo not in _SUPPORTED:
        return None
    if crc != zlib.crc32(raw[pad : pad + _HEADER.size]) or tag != name_tag(name):
        return None
    zeros = _ZERO_PADDING.get(pad) or _ZERO_PADDING.setdefault(pad, bytes(pad))
    if bytes(raw[:pad]) != zeros:  # bytes(): a memoryview compares item by item, 40x slower
        return None
    if payload_len is None:
        payload_len = sum(memoryview(p).nbytes for p in pieces)
    if stored_len != payload_len or payload_checksum(pieces, _SUPPORTED[algo]) != checksum:
        return None
    return checksum, digest


def page_is_whole(results: list[tuple[int, int] | None]) -> bool:
    """Every object of a page verified and all were written by the same page write."""
    if not results or any(r is None for r in results):
        return False
    if len(results) == 1:
        return results[0][1] == page_digest([results[0][0]])
    digest = page_digest([checksum for checksum, _ in results])
    return all(d == digest for _, d in results)


def poison_trailer(trailer) -> None:
    """Overwrite the header bytes of a read buffer's trailer (a writable numpy uint8 array) with
    a pattern no valid header has, so that bytes a short read did not deliver fail the check."""
    trailer[-HEADER_BYTES:] = 0xFF
