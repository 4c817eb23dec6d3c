"""A digest of a checkpoint's content: the model identity of the L3 storage namespace.

Two servers share L3 pages only when their KV bytes would be equal, so the namespace names the
weights, not the directory or its basename (checkpoint B copied over A's directory must not read
A's pages). Hashing hundreds of GB at every start is too slow, so the digest covers what decides
the weights and is cheap to read (docs/storage_keys.md, "Checkpoint fingerprint"):

- ``config.json``, parsed and dumped again with sorted keys (key order and whitespace do not count);
- per safetensors file the checkpoint loads (``weight_utils.safetensors_files``, sorted by name):
  its name, its size, its whole header (8-byte length + JSON: every tensor's name, dtype, shape and
  offsets), and the first and last ``SAMPLE_BYTES`` of every tensor's data (``os.pread``);
- a ``--load-format dummy`` model: ``dummy`` and the seed instead of files.

Not the path: the same checkpoint at another path may share pages. Reads are bounded by the
headers plus ``2 x SAMPLE_BYTES`` per tensor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SCHEME = b"sglang-checkpoint-fingerprint-v1"
SAMPLE_BYTES = 4096  # read at each end of every tensor
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
STORAGE_ID_HEX = 16  # hex digits of the fingerprint in the storage model id


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # SHA-256, hex
    num_files: int
    num_tensors: int
    bytes_read: int  # config, headers and tensor samples; what the computation cost in I/O


def _frame(h, tag: bytes, data: bytes) -> None:
    """Length-prefixed fields, so no two field sequences hash the same bytes."""
    h.update(tag + b"\0" + len(data).to_bytes(8, "little") + data)


def _pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ValueError(f"{path}: short read ({len(data)} of {length} bytes at offset {offset})")
    return data


def canonical_config(model_path: str) -> bytes:
    """config.json as canonical JSON (sorted keys, no whitespace). ValueError when absent or not JSON."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint fingerprint: cannot read {path}: {exc}") from None
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _tensor_ranges(header: dict, data_start: int, file_size: int, path: str) -> list[tuple[int, int]]:
    """(file offset, length) of every range sampled from the tensors' data, in file order."""
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets") from None
        if not 0 <= begin <= end or data_start + end > file_size:
            raise ValueError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] lie outside the file")
        begin, end = data_start + begin, data_start + end
        if end - begin <= 2 * SAMPLE_BYTES:
            ranges.append((begin, end - begin))
        else:
            ranges += [(begin, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]
    return sorted(ranges)


def _hash_safetensors(h, path: str) -> tuple[int, int]:
    """Feed one file's name, size, header and tensor samples to ``h``; (tensors, bytes read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        head = _pread_exact(fd, 8, 0, path)
        header_len = int.from_bytes(head, "little")
        if header_len > min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path}: safetensors header length {header_len} exceeds the file ({file_size} bytes)")
        header_bytes = _pread_exact(fd, header_len, 8, path)
        try:
            header = json.loads(header_bytes)
        except ValueError as exc:
            raise ValueError(f"{path}: safetensors header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: safetensors header is not a JSON object")
        _frame(h, b"file", os.path.basename(path).encode("utf-8"))
        _frame(h, b"size", file_size.to_bytes(8, "little"))
        _frame(h, b"header", head + header_bytes)
        ranges = _tensor_ranges(header, 8 + header_len, file_size, path)
        sampled = 0
        for offset, length in ranges:
            _frame(h, b"sample", _pread_exact(fd, length, offset, path))
            sampled += length
        num_tensors = sum(1 for k in header if k != "__metadata__")
        return num_tensors, 8 + header_len + sampled
    finally:
        os.close(fd)


def compute_fingerprint(model_path: str, load_format: str, seed: int) -> Fingerprint:
    """The fingerprint of the checkpoint at ``model_path`` as ``load_format`` loads it (uncached).
    ``seed`` counts only for ``dummy`` weights. ValueError on a missing or malformed file."""
    h = hashlib.sha256(SCHEME)
    config = canonical_config(model_path)
    _frame(h, b"config", config)
    if load_format == "dummy":
        _frame(h, b"dummy", str(int(seed)).encode("ascii"))
        return Fingerprint(h.hexdigest(), 0, 0, len(config))
    from sglang.srt.model_executor.weight_utils import safetensors_files  # torch: not at import

    files = sorted(safetensors_files(model_path), key=os.path.basename)
    num_tensors, bytes_read = 0, len(config)
    for path in files:
        tensors, read = _hash_safetensors(h, path)
        num_tensors, bytes_read = num_tensors + tensors, bytes_read + read
    return Fingerprint(h.hexdigest(), len(files), num_tensors, bytes_read)


@functools.lru_cache(maxsize=None)
def checkpoint_fingerprint(model_path: str, load_format: str, seed: int) -> str:
    """SHA-256 hex of the checkpoint (``compute_fingerprint``), once per process and arguments;
    logged at INFO the first time."""
    fp = compute_fingerprint(model_path, load_format, seed)
    logger.info("checkpoint fingerprint %s (%d safetensors files, %d tensors, %d bytes read%s)", fp.digest,
                fp.num_files, fp.num_tensors, fp.bytes_read, ", dummy weights" if load_format == "dummy" else "")
    return fp.digest


def storage_model_name(args) -> str:
    """The model identity of the L3 namespace for ServerArgs ``args``: ``<model_name>@<16 hex digits
    of the fingerprint>``. ``model_name`` alone stays the user-facing name (metrics, model info)."""
    digest = checkpoint_fingerprint(args.model_path, args.load_format, args.random_seed)
    return f"{args.model_name}@{digest[:STORAGE_ID_HEX]}"
