"""Storage (L3) key scheme: object names derived from the keys the controller passes.

A key is normally the tree's page hash (``radix/page_hash.py``: 64 hex digits naming a token
prefix inside one request namespace); like upstream, any non-empty string is accepted (a test's
``"h0"``, another engine's key). A key does not say which bytes a pool holds for that prefix:
that depends on the model, the pool's byte format (kind, dtype, layout order, geometry, page
size, pages per key) and which shard of the model this rank holds. :class:`StorageNamespace`
collects exactly those facts for one pool and hashes them into a digest; an object's name is

    sha256(namespace digest || key bytes) hex  +  fixed suffix ("_k", "_mamba_conv_0", ...)

where the key bytes are the 32 bytes a page hash spells, or a tagged UTF-8 encoding of any
other key, so the two kinds never collide. Pages that could hold different bytes never share a
name, and nothing a caller passes reaches a path: every key is hashed before use.
See ``docs/storage_keys.md``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

from sglang.srt.mem_cache.memory_pool.base import SHARD_MODE, ShardMode

KEY_SCHEME_VERSION = "sglang-hicache-l3-v2"
_PAGE_HASH = re.compile(r"[0-9a-f]{64}")
_TEXT_KEY_TAG = b"sglang-hicache-text-key\0"  # 24 bytes: never the 32 bytes of a page hash


# Object suffix tag of a component where it differs from the component's name ("" = no tag).
_COMPONENT_TAG = {"kv": "k", "index_k": "k", "index_scale": "v", "state": ""}
MARKER_TAG = "marker"


def check_key(key: str) -> str:
    """Return ``key`` when it is a non-empty string; ValueError otherwise."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"storage key must be a non-empty string, got {key!r}")
    return key


def key_bytes(key: str) -> bytes:
    """What a key contributes to a name: a page hash (64 lowercase hex digits) as its 32 bytes,
    any other non-empty string tagged and UTF-8 encoded. ValueError for anything else."""
    if isinstance(key, str) and len(key) == 64 and _PAGE_HASH.fullmatch(key):
        return bytes.fromhex(key)
    return _TEXT_KEY_TAG + check_key(key).encode("utf-8", "surrogatepass")


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
    tag: str = ""  # extra_backend_tag (upstream's tenant tag); hashed only when set
    dp: int = 0  # attention data-parallel rank (upstream's dp_rank)
    pages_per_key: int = 1  # host pages one key covers (span mode: storage_page_size / page_size)

    @classmethod
    def for_pool(cls, config: "HiCacheStorageConfig", host_pool, pool_name: str, object_format: str,
                 shard: ShardMode | None = None, page_format: str | None = None, kv_dtype: str | None = None,
                 pages_per_key: int = 1):
        """The namespace of ``host_pool`` (registered as ``pool_name``) on this rank. ``shard``,
        ``page_format`` and ``kv_dtype`` default to the pool's own (``kind``, ``page_format``,
        ``dtype``); a pool without them (an upstream-style pool) passes what was derived."""
        shard = SHARD_MODE[host_pool.kind] if shard is None else shard
        tp = "replicated" if shard is ShardMode.REPLICATED else f"{config.tp_rank}/{config.tp_size}"
        return cls(
            model_name=config.model_name,
            pool_name=str(pool_name),
            page_format=host_pool.page_format if page_format is None else page_format,
            kv_dtype=str(host_pool.dtype).removeprefix("torch.") if kv_dtype is None else kv_dtype,
            page_size=host_pool.page_size,
            tp=tp,
            pp=f"{config.pp_rank}/{config.pp_size}",
            cp=f"{config.attn_cp_rank}/{config.attn_cp_size}",
            object_format=object_format,
            salt=config.namespace_salt,
            tag=getattr(config, "extra_backend_tag", ""),
            dp=config.dp_rank,
            pages_per_key=pages_per_key,
        )

    @property
    def shard_mode(self) -> ShardMode:
        return ShardMode.REPLICATED if self.tp == "replicated" else ShardMode.SHARDED

    def digest(self) -> bytes:
        fields = asdict(self)
        if not fields["tag"]:  # untagged namespaces keep the names they had before tags existed
            del fields["tag"]
        blob = json.dumps({"v": KEY_SCHEME_VERSION, **fields}, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).digest()


def page_group(key: str) -> str:
    """The 32-hex-digit group of a key: shared by every object of every pool stored under that
    key, so file stores can place them in one directory and evict them together."""
    return hashlib.sha256(b"sglang-hicache-page-group\0" + key_bytes(key)).hexdigest()[:32]


GROUP_SEPARATOR = "."


class KeyDeriver:
    """Maps keys to object name stems for one namespace (cached digest)."""

    def __init__(self, namespace: StorageNamespace):
        self.namespace = namespace
        self._digest = namespace.digest()

    def stem(self, key: str) -> str:
        """Hex name stem of the page named by ``key`` (ValueError unless a non-empty string)."""
        return hashlib.sha256(self._digest + key_bytes(key)).hexdigest()
