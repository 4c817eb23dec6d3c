"""Storage (L3) key scheme: object names derived from the tree's page hashes.

A page hash (``page_hash.py``) names a token prefix inside one request namespace (LoRA id,
tenant cache_salt). It does not say which bytes a pool holds for that prefix: that depends on
the model, the pool's byte format (kind, dtype, layout order, geometry, page size) and which
shard of the model this rank holds. :class:`StorageNamespace` collects exactly those facts for
one pool and hashes them into a digest; an object's name is

    sha256(namespace digest || page hash bytes) hex  +  fixed suffix ("_k", "_mamba_conv_0", ...)

so pages that could hold different bytes never share a name, and nothing a request controls
reaches a path: the page hash is checked to be 64 hex digits and hashed again before use.
See ``docs/storage_keys.md``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, ShardMode

KEY_SCHEME_VERSION = "sglang-hicache-l3-v1"
_PAGE_HASH = re.compile(r"[0-9a-f]{64}")


# Object suffix tag of a component where it differs from the component's name ("" = no tag).
_COMPONENT_TAG = {"kv": "k", "index_k": "k", "index_scale": "v", "state": ""}
MARKER_TAG = "marker"


def check_page_hash(page_hash: str) -> str:
    """Return ``page_hash`` when it is 64 lowercase hex digits; ValueError otherwise."""
    if not isinstance(page_hash, str) or not _PAGE_HASH.fullmatch(page_hash):
        raise ValueError(f"storage key must be a page hash of 64 lowercase hex digits, got {page_hash!r}")
    return page_hash


def object_suffix(pool_name: str, tag: str) -> str:
    """Fixed suffix of an object: ``_<tag>`` for the KV pool, ``_<pool>[_<tag>]`` for side pools."""
    parts = ([] if pool_name == "kv" else [pool_name]) + ([tag] if tag else [])
    return "".join(f"_{p}" for p in parts)


def component_tag(component_name: str) -> str:
    return _COMPONENT_TAG.get(component_name, component_name)


@dataclass(frozen=True)
class StorageNamespace:
    """Everything besides the token prefix that determines the bytes of one pool's pages."""

    model_name: str
    pool_name: str
    page_format: str
    kv_dtype: str
    page_size: int
    tp: str  # "rank/size", or "replicated"
    pp: str
    cp: str
    object_format: str  # the backend's framing of a stored object (e.g. "nixl-seg/t4096")
    salt: str = ""

    @classmethod
    def for_pool(cls, config: "HiCacheStorageConfig", host_pool, pool_name: str, object_format: str):
        """The namespace of ``host_pool`` (registered as ``pool_name``) on this rank."""
        shard = SHARD_MODE[host_pool.kind]
        tp = "replicated" if shard is ShardMode.REPLICATED else f"{config.tp_rank}/{config.tp_size}"
        return cls(
            model_name=config.model_name,
            pool_name=str(pool_name),
            page_format=host_pool.page_format,
            kv_dtype=str(host_pool.dtype).removeprefix("torch."),
            page_size=host_pool.page_size,
            tp=tp,
            pp=f"{config.pp_rank}/{config.pp_size}",
            cp=f"{config.attn_cp_rank}/{config.attn_cp_size}",
            object_format=object_format,
            salt=config.namespace_salt,
        )

    @property
    def shard_mode(self) -> ShardMode:
        return ShardMode.REPLICATED if self.tp == "replicated" else ShardMode.SHARDED

    def digest(self) -> bytes:
        blob = json.dumps({"v": KEY_SCHEME_VERSION, **asdict(self)}, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).digest()


def page_group(page_hash: str) -> str:
    """The 32-hex-digit group of a page: shared by every object of every pool stored for that page
    hash, so file stores can place them in one directory and evict them together."""
    return hashlib.sha256(b"sglang-hicache-page-group\0" + bytes.fromhex(check_page_hash(page_hash))).hexdigest()[:32]


GROUP_SEPARATOR = "."


class KeyDeriver:
    """Maps page hashes to object name stems for one namespace (cached digest)."""

    def __init__(self, namespace: StorageNamespace):
        self.namespace = namespace
        self._digest = namespace.digest()

    def stem(self, page_hash: str) -> str:
        """Hex name stem of the page named by ``page_hash`` (ValueError on a malformed hash)."""
        return hashlib.sha256(self._digest + bytes.fromhex(check_page_hash(page_hash))).hexdigest()
