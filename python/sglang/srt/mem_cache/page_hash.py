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

_SEED_TAG = b"sglang-hicache-page-chain-v1\x00"
_MAX_TOKEN_ID = (1 << 32) - 1


def namespace_hash(extra_key: str | None = None) -> str:
    """Seed digest (hex) of a namespace; ``None`` and ``""`` are the default namespace."""
    return hashlib.sha256(_SEED_TAG + (extra_key or "").encode("utf-8")).hexdigest()


def hash_page(prior_hash: str, token_ids: Sequence[int]) -> str:
    """Hash of one page given the previous page's hash (or the namespace seed)."""
    h = hashlib.sha256(bytes.fromhex(prior_hash))
    for tok in token_ids:
        tok = int(tok)
        if not 0 <= tok <= _MAX_TOKEN_ID:
            raise ValueError(f"token id {tok} outside [0, {_MAX_TOKEN_ID}]")
        h.update(tok.to_bytes(4, "little"))
    return h.hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str) -> list[str]:
    """Hashes of every whole page of ``token_ids`` (a trailing partial page is ignored)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    out = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prior_hash = hash_page(prior_hash, token_ids[start : start + page_size])
        out.append(prior_hash)
    return out
