"""Integrity trailers of a whole batch of objects at once, built and checked with numpy.

The trailer of an object is fully determined by its name, payload length, payload checksum and
page digest (``integrity.py``). So instead of parsing each trailer read back field by field,
a reader computes the checksums of the payloads it read (one native xxhash pass per object),
builds the one valid trailer of every object of the batch here, and compares all of them with
the bytes read in one numpy comparison. That is exactly as strict as :func:`read_trailer` plus
:func:`page_is_whole` (every trailer byte must equal the only valid value, padding and header
CRC included), and a mismatch is then classified by those per-object functions (slow path).

Writers use the same builder, so both sides produce byte-identical trailers.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Sequence

import numpy as np

from sglang.srt.mem_cache.storage.integrity import (
    DEFAULT_CHECKSUM,
    HEADER_BYTES,
    MAGIC,
    MIN_TRAILER_BYTES,
    VERSION,
    Checksum,
    page_digest,
    payload_checksum,
    xxhash,
)

# The packed (unaligned) numpy twin of integrity._HEADER + its CRC: 56 bytes.
HEADER_DTYPE = np.dtype([("magic", "S8"), ("version", "<u2"), ("algo", "<u2"), ("len", "<u8"),
                         ("checksum", "<u8"), ("digest", "<u8"), ("tag", "S16"), ("crc", "<u4")])
assert HEADER_DTYPE.itemsize == HEADER_BYTES
_CRC_SPAN = HEADER_BYTES - 4
_sha256 = hashlib.sha256
_crc32 = zlib.crc32
_xxh3 = xxhash.xxh3_64_intdigest if xxhash is not None and DEFAULT_CHECKSUM is Checksum.XXH3_64 else None


def checksums(views: Sequence[Sequence]) -> list[int]:
    """Payload checksum of each object (``views[i]``: the buffers of object ``i``, in order).
    (Hashing through ctypes, which releases the GIL, measured slower here: 0.6-0.7x instead of
    0.8-1.0x of the baseline for 1 MiB file reads on two threads.)"""
    if _xxh3 is not None:
        h = _xxh3
        return [h(v[0]) if len(v) == 1 else payload_checksum(v) for v in views]
    return [payload_checksum(v) for v in views]


def digests(sums: list[int], objects_per_page: Sequence[int]) -> list[int]:
    """Per object, the page digest of its page (objects are page after page, in order)."""
    if all(n == 1 for n in objects_per_page):  # page_digest([c]), inlined
        b2, from_bytes = hashlib.blake2b, int.from_bytes
        return [from_bytes(b2(c.to_bytes(8, "little"), digest_size=8).digest(), "little") for c in sums]
    out, i = [], 0
    for n in objects_per_page:
        d = page_digest(sums[i : i + n])
        out.extend([d] * n)
        i += n
    return out


_TAG_CACHE: dict[str, bytes] = {}
_TAG_CACHE_MAX = 1 << 17  # ~20 MiB at most


def _tags(names: Sequence[str]) -> list[bytes]:
    """``integrity.name_tag`` of each name, cached: a page is usually read by the process that
    wrote or checked it, and the sha256 costs more than its share of a 64 KiB page's I/O."""
    cache, out = _TAG_CACHE, []
    for name in names:
        tag = cache.get(name)
        if tag is None:
            if len(cache) >= _TAG_CACHE_MAX:
                cache.clear()
            tag = cache[name] = _sha256(name.encode("utf-8")).digest()[:16]
        out.append(tag)
    return out


def headers(names: Sequence[str], lengths: Sequence[int], sums: Sequence[int],
            page_digests: Sequence[int]) -> np.ndarray:
    """(len(names), HEADER_BYTES) uint8: the header (with its CRC) that ends the trailer of
    object ``names[i]`` (payload ``lengths[i]`` bytes, checksum ``sums[i]``, page digest
    ``page_digests[i]``) with the default algorithm."""
    n = len(names)
    head = np.zeros(n, dtype=HEADER_DTYPE)
    head["magic"] = MAGIC
    head["version"] = VERSION
    head["algo"] = int(DEFAULT_CHECKSUM)
    head["len"] = np.asarray(lengths, dtype=np.uint64)
    head["checksum"] = np.asarray(sums, dtype=np.uint64)
    head["digest"] = np.asarray(page_digests, dtype=np.uint64)
    head["tag"] = _tags(names)
    raw = head.view(np.uint8).reshape(n, HEADER_BYTES)
    blob = memoryview(raw.tobytes())
    head["crc"] = [_crc32(blob[i : i + _CRC_SPAN]) for i in range(0, n * HEADER_BYTES, HEADER_BYTES)]
    return raw


def build(names: Sequence[str], lengths: Sequence[int], sums: Sequence[int], page_digests: Sequence[int],
          trailer_bytes: int) -> np.ndarray:
    """(len(names), trailer_bytes) uint8: row ``i`` is the trailer :func:`pack_trailer` writes
    for object ``names[i]`` (zero padding, then :func:`headers`)."""
    if trailer_bytes < MIN_TRAILER_BYTES:
        raise ValueError(f"trailer_bytes must be >= {MIN_TRAILER_BYTES}, got {trailer_bytes}")
    out = np.zeros((len(names), trailer_bytes), dtype=np.uint8)
    out[:, trailer_bytes - HEADER_BYTES :] = headers(names, lengths, sums, page_digests)
    return out


def verify(read: np.ndarray, names: Sequence[str], lengths: Sequence[int], sums: Sequence[int],
           page_digests: Sequence[int]) -> np.ndarray:
    """Per row of ``read`` (trailers as read, (n, trailer_bytes) uint8): whether it is exactly
    the trailer :func:`build` gives, every byte checked, without building the padding."""
    pad = read.shape[1] - HEADER_BYTES
    if pad < MIN_TRAILER_BYTES - HEADER_BYTES:
        raise ValueError(f"trailers of {read.shape[1]} bytes; at least {MIN_TRAILER_BYTES} expected")
    good = (read[:, pad:] == headers(names, lengths, sums, page_digests)).all(axis=1)
    padding = read[:, :pad]
    if pad % 8 == 0 and read.strides[1] == 1 and read.ctypes.data % 8 == 0 and read.strides[0] % 8 == 0:
        padding = padding.view(np.uint64)  # 8x fewer elements to test
    return good & ~padding.any(axis=1)


def matches(read: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row: whether the trailer bytes read equal the expected ones (bool array)."""
    return (read == expected).all(axis=1)
