"""The page hash chain that names every page of the tree (and, through storage keys, of L3).

A page's hash is SHA-256 over the previous page's digest followed by the page's token ids as
4-byte little-endian unsigned integers. The first page chains from a *namespace seed* derived
from the request's extra key (LoRA id, tenant cache_salt), so equal tokens under different
namespaces never share a hash, and a chain never silently restarts mid-sequence. Hashes are
hex strings. Storage backends derive their keys from these plus their own namespace
(model, dtype, page format, shard coordinates).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

_SEED_TAG = b"sglang-hicache-page-chain-v1\x00"
_MAX_TOKEN_ID = (1 << 32) - 1


# What "" seeds with: a byte that no UTF-8 text contains, so the seed stays injective while
# None (the default namespace) and every non-empty key keep the seed they always had.
_EMPTY_KEY_TAG = b"\xff"


def namespace_hash(extra_key: str | None = None) -> str:
    """Seed digest (hex) of a namespace. ``None`` is the default namespace; ``""`` is a
    namespace of its own (the tree files it apart from ``None``, so its hashes differ too)."""
    if extra_key is None:
        return hashlib.sha256(_SEED_TAG).hexdigest()
    return hashlib.sha256(_SEED_TAG + (extra_key.encode("utf-8") or _EMPTY_KEY_TAG)).hexdigest()


def _page_bytes(token_ids) -> bytes:
    """``token_ids`` as 4-byte little-endian unsigned ints; ValueError naming a bad id."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
        bad = int(arr[(arr < 0) | (arr > _MAX_TOKEN_ID)][0])
        raise ValueError(f"token id {bad} outside [0, {_MAX_TOKEN_ID}]")
    return arr.astype("<u4").tobytes()


def hash_page(prior_hash: str, token_ids: Sequence[int]) -> str:
    """Hash of one page given the previous page's hash (or the namespace seed)."""
    return hashlib.sha256(bytes.fromhex(prior_hash) + _page_bytes(token_ids)).hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str) -> list[str]:
    """Hashes of every whole page of ``token_ids`` (a sequence or an int array; a trailing
    partial page is ignored). One pass converts the ids; the chain is one hash per page."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = len(token_ids) // page_size
    data = memoryview(_page_bytes(token_ids[: pages * page_size]))
    step, out = 4 * page_size, []
    for i in range(pages):
        prior_hash = hashlib.sha256(bytes.fromhex(prior_hash) + data[i * step : (i + 1) * step]).hexdigest()
        out.append(prior_hash)
    return out
