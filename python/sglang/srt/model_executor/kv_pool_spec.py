"""What a model caches, stated by the model class, and the device pools built from it.

A model class answers ``kv_pool_layout(model_config, tp_size) -> KVPoolLayout``: the pool kind
and shapes of its anchor (the token slots the radix tree tracks), of any sidecars addressed with
the anchor's slots (DSA indexer keys, DeepSeek-V4 compressed rows), and of a state pool with
slots of its own (Mamba / linear-attention states, one per request or cached prefix).

The model runner builds the device pools from that through ``DEVICE_POOL_CLASSES``; the cache
factory maps the same kinds to host pools and hybrid stacks. Nothing else looks at a model name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang.srt.mem_cache.memory_pool.base import KVCache, PoolKind
from sglang.srt.mem_cache.memory_pool.dsa import DSAIndexerPool
from sglang.srt.mem_cache.memory_pool.dsv4 import DeepSeekV4StatePool, LogicalAnchorPool
from sglang.srt.mem_cache.memory_pool.mamba import MambaPool
from sglang.srt.mem_cache.memory_pool.mha import AsymmetricMHATokenToKVPool, MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.mla import MLATokenToKVPool

# Pool kind -> device pool class. Token pools take (size, page_size, device, **args); the Mamba
# state pool has no page size (one slot per state).
DEVICE_POOL_CLASSES: dict[PoolKind, type[KVCache]] = {
    PoolKind.MHA: MHATokenToKVPool,
    PoolKind.ASYMMETRIC_MHA: AsymmetricMHATokenToKVPool,
    PoolKind.MLA: MLATokenToKVPool,
    PoolKind.DSA_INDEXER: DSAIndexerPool,
    PoolKind.DSV4_ANCHOR: LogicalAnchorPool,
    PoolKind.DSV4_STATE: DeepSeekV4StatePool,
    PoolKind.MAMBA: MambaPool,
}
SIDECAR_KINDS = (PoolKind.DSA_INDEXER, PoolKind.DSV4_STATE)
STATE_KINDS = (PoolKind.MAMBA,)


@dataclass(frozen=True)
class PoolSpec:
    """One device pool: its kind and the constructor arguments other than size, page size and
    device (shapes, dtypes, ``layer_num``)."""

    kind: PoolKind
    args: dict = field(default_factory=dict)

    def build(self, size: int, page_size: int, device: torch.device | str) -> KVCache:
        cls = DEVICE_POOL_CLASSES[self.kind]
        if self.kind in STATE_KINDS:
            return cls(size=size, device=device, **self.args)
        return cls(size=size, page_size=page_size, device=device, **self.args)


@dataclass(frozen=True)
class KVPoolLayout:
    """Anchor + sidecars (same slots) + an optional own-slot state pool."""

    anchor: PoolSpec
    sidecars: tuple[PoolSpec, ...] = ()
    state: PoolSpec | None = None

    def __post_init__(self):
        if self.anchor.kind in SIDECAR_KINDS or self.anchor.kind in STATE_KINDS:
            raise ValueError(f"{self.anchor.kind.value} cannot be an anchor pool")
        for side in self.sidecars:
            if side.kind not in SIDECAR_KINDS:
                raise ValueError(f"{side.kind.value} cannot be a sidecar; sidecar kinds: "
                                 f"{[k.value for k in SIDECAR_KINDS]}")
        if self.state is not None and self.state.kind not in STATE_KINDS:
            raise ValueError(f"{self.state.kind.value} cannot be a state pool; state kinds: "
                             f"{[k.value for k in STATE_KINDS]}")

    def bytes_per_token(self, page_size: int) -> int:
        """Device bytes one anchor slot costs, sidecars included (measured on a one-page pool)."""
        return sum(spec.build(page_size, page_size, "meta").get_size_per_token()
                   for spec in (self.anchor, *self.sidecars))


def mha_layout(dtype: torch.dtype, layer_num: int, head_num: int, head_dim: int,
               v_head_dim: int | None = None) -> KVPoolLayout:
    """K/V per token; an asymmetric pool when ``v_head_dim`` differs from ``head_dim``."""
    args = dict(dtype=dtype, head_num=head_num, head_dim=head_dim, layer_num=layer_num)
    if v_head_dim is None or v_head_dim == head_dim:
        return KVPoolLayout(PoolSpec(PoolKind.MHA, args))
    return KVPoolLayout(PoolSpec(PoolKind.ASYMMETRIC_MHA, {**args, "v_head_dim": v_head_dim}))
