"""Fixtures for the tree tests: tiny real pools, deterministic KV bytes, a request record.

The KV of a token is a deterministic function of its whole prefix (and namespace), so any slot
the tree reports for a prefix can be checked byte for byte, wherever the bytes travelled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    build_dsv4_stack,
    build_nsa_hybrid_stack,
    build_mamba_hybrid_stack,
)
from sglang.srt.mem_cache.memory_pool import (
    DeepSeekV4StatePool,
    DSAIndexerPool,
    LogicalAnchorPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.radix.tree_node import RadixKey, TreeNode

LAYERS, HEADS, HEAD_DIM = 2, 1, 2


def make_params(page_size=1, device_pages=16, eviction_policy="lru", layer_num=LAYERS, device="cpu",
                **kwargs) -> CacheInitParams:
    pool = MHATokenToKVPool(device_pages * page_size, page_size, torch.float32, HEADS, HEAD_DIM, layer_num, device)
    alloc = PagedTokenToKVPoolAllocator(pool.size, page_size, kvcache=pool)
    return CacheInitParams(page_size=page_size, token_to_kv_pool_allocator=alloc, eviction_policy=eviction_policy, **kwargs)


def make_radix(page_size=1, device_pages=16, eviction_policy="lru") -> RadixCache:
    return RadixCache(make_params(page_size, device_pages, eviction_policy))


def make_hicache(page_size=1, device_pages=16, host_pages=32, write_policy="write_through", eviction_policy="lru",
                 io_backend="direct", layout="layer_first", host_cls=MHATokenToKVPoolHost, load_back_threshold=0,
                 layer_num=LAYERS, device="cpu", storage: dict | None = None, prefetch_policy="timeout",
                 **param_kwargs) -> HiRadixCache:
    """``storage``: HiCacheController keyword arguments that attach an L3 backend
    (``storage_backend``, ``storage_backend_extra_config``, ``model_name``)."""
    params = make_params(page_size, device_pages, eviction_policy, layer_num, device, **param_kwargs)
    device_pool = params.token_to_kv_pool_allocator.get_kvcache()
    host = host_cls(device_pool, size=host_pages * page_size, layout=layout, io_backend=io_backend)
    controller = HiCacheController.from_params(params, host, write_policy=write_policy, **(storage or {}))
    return HiRadixCache(params, controller, load_back_threshold, prefetch_policy)


def token_values(tokens: Sequence[int], extra_key: str | None = None) -> torch.Tensor:
    """One float per token, a function of the namespace and every token up to it (exact in fp32)."""
    h = sum((i + 1) * ord(c) for i, c in enumerate(extra_key or "")) % 1009
    out = []
    for t in tokens:
        h = (h * 131 + int(t) + 7) % 65521
        out.append(float(h + 1))
    return torch.tensor(out, dtype=torch.float32)


def expected_kv(tokens, extra_key=None, layer_num=LAYERS) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) shaped (layers, tokens, heads, head_dim)."""
    v = token_values(tokens, extra_key)
    layer = torch.arange(layer_num, dtype=torch.float32).view(-1, 1, 1, 1) / 8
    elem = torch.arange(HEADS * HEAD_DIM, dtype=torch.float32).view(1, 1, HEADS, HEAD_DIM) / 16
    k = v.view(1, -1, 1, 1) + layer + elem
    return k, -k


def write_kv(pool, slots: torch.Tensor, tokens, extra_key=None, start: int = 0) -> None:
    """Write the KV of ``tokens[start:]`` into ``slots[start:]`` (what a forward pass does)."""
    k, v = expected_kv(tokens, extra_key, pool.layer_num)
    idx = slots[start:].to(pool.device)
    pool.buffers["k"][:, idx] = k[:, start:].to(pool.device)
    pool.buffers["v"][:, idx] = v[:, start:].to(pool.device)


def assert_kv(pool, slots: torch.Tensor, tokens, extra_key=None) -> None:
    k, v = expected_kv(tokens, extra_key, pool.layer_num)
    idx = slots.to(pool.device)
    got_k, got_v = pool.buffers["k"][:, idx].cpu(), pool.buffers["v"][:, idx].cpu()
    assert torch.equal(got_k.view(torch.int32), k.view(torch.int32)), "K bytes differ"
    assert torch.equal(got_v.view(torch.int32), v.view(torch.int32)), "V bytes differ"


@dataclass
class Req:
    """What the tree reads from a request (see RadixCache's module docstring)."""

    fill_ids: list[int]
    extra_key: str | None
    kv_indices: torch.Tensor
    prefix_indices: torch.Tensor
    last_node: TreeNode
    host_hit_length: int = 0
    loaded: int = 0


def pattern_kv(pool, tokens, salt: float = 0.0) -> dict[str, torch.Tensor]:
    """Per component of ``pool`` (any kind): (layers, tokens, ...) values in the pool's dtype, a
    function of every token up to each position and of ``salt`` (e.g. the TP rank)."""
    v = token_values(tokens)
    out = {}
    for name, buf in pool.buffers.items():
        layers, shape = buf.shape[0], tuple(buf.shape[2:])
        ones = (1,) * len(shape)
        t = (v.view(1, -1, *ones) + salt + torch.arange(layers, dtype=torch.float32).view(layers, 1, *ones) / 8
             + torch.arange(math.prod(shape), dtype=torch.float32).view(1, 1, *shape) / 16)
        out[name] = t.to(buf.dtype)
    return out


def write_pattern(pool, slots: torch.Tensor, tokens, salt: float = 0.0, start: int = 0) -> None:
    """Write ``pattern_kv`` of ``tokens[start:]`` into ``slots[start:]`` of every component."""
    idx = slots[start:].to(pool.device)
    for name, values in pattern_kv(pool, tokens, salt).items():
        pool.buffers[name][:, idx] = values[:, start:].to(pool.device)


def pattern_matches(pool, slots: torch.Tensor, tokens, salt: float = 0.0) -> bool:
    """Whether every component at ``slots`` holds exactly ``pattern_kv(tokens, salt)`` (bytes)."""
    idx = slots.to(pool.device)
    return all(
        torch.equal(pool.buffers[name][:, idx].cpu().contiguous().view(torch.uint8), values.view(torch.uint8))
        for name, values in pattern_kv(pool, tokens, salt).items()
    )


def start_request(cache, tokens, extra_key=None, load_back=True, writer=None) -> Req | None:
    """Match, load back host hits, lock, allocate the rest (evicting if needed) and write the new
    tokens' KV (``writer(pool, slots, tokens, start)``, default ``write_kv``). Returns None
    (nothing held) when the device is too full."""
    P = cache.page_size
    alloc = cache.token_to_kv_pool_allocator
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra_key)))
    prefix, last, loaded = m.device_indices, m.last_device_node, 0
    if load_back and m.host_hit_length:
        got = cache.init_load_back(m.last_host_node, m.host_hit_length)
        if got is not None:
            prefix, last, loaded = torch.cat([prefix, got]), m.last_host_node, got.numel()
            cache.ready_to_load_host_cache()
    cache.inc_lock_ref(last)
    need = math.ceil((len(tokens) - prefix.numel()) / P) * P
    if alloc.available_size() < need:
        cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
    slots = alloc.alloc(need)
    if loaded:  # the forward waits for every layer of the batch's load, admitted or not
        cache.cache_controller.load_lane.synchronize()
    if slots is None:
        cache.dec_lock_ref(last)
        return None
    kv = torch.cat([prefix, slots])[: len(tokens)]
    if writer is None:
        write_kv(alloc.get_kvcache(), kv, tokens, extra_key, start=prefix.numel())
    else:
        writer(alloc.get_kvcache(), kv, tokens, prefix.numel())
    return Req(list(tokens), extra_key, kv, prefix, last, m.host_hit_length, loaded)


def held_pages(cache, reqs) -> list[torch.Tensor]:
    """Whole pages held by running requests (their tail pages included)."""
    P, out = cache.page_size, []
    for r in reqs:
        own = r.kv_indices[r.prefix_indices.numel():]
        if own.numel():
            pages = torch.unique(own // P)
            out.append((pages.view(-1, 1) * P + torch.arange(P)).view(-1))
    return out


# ---- hybrid stacks ----------------------------------------------------------------------
HYBRID_PAGE, HYBRID_SLOTS = 2, 16


def params_for(pool, **coords) -> CacheInitParams:
    alloc = PagedTokenToKVPoolAllocator(pool.size, pool.page_size, kvcache=pool)
    return CacheInitParams(page_size=pool.page_size, token_to_kv_pool_allocator=alloc, **coords)


def kv_mamba_stack(config: HiCacheConfig | None = None, mamba_slots: int = 4, **coords):
    kv = MHATokenToKVPool(HYBRID_SLOTS, HYBRID_PAGE, torch.float32, 1, 2, LAYERS)
    mamba = MambaPool(mamba_slots, [(2, 3)], (2, 2), LAYERS + 1, conv_dtype=torch.bfloat16)
    return build_mamba_hybrid_stack(params_for(kv, **coords), mamba, config or HiCacheConfig(io_backend="direct"))


def kv_dsa_stack(config: HiCacheConfig | None = None, **coords):
    kv = MLATokenToKVPool(HYBRID_SLOTS, HYBRID_PAGE, torch.bfloat16, 4, 2, LAYERS)
    indexer = DSAIndexerPool(HYBRID_SLOTS, HYBRID_PAGE, 4, LAYERS - 1)
    return build_nsa_hybrid_stack(params_for(kv, **coords), indexer, config or HiCacheConfig(io_backend="direct"))


def dsv4_stack(config: HiCacheConfig | None = None, **coords):
    anchor = LogicalAnchorPool(HYBRID_SLOTS, HYBRID_PAGE, LAYERS)
    state = DeepSeekV4StatePool(HYBRID_SLOTS, HYBRID_PAGE, 6, LAYERS)
    return build_dsv4_stack(params_for(anchor, **coords), state, config or HiCacheConfig(io_backend="direct"))


STACKS = {"kv_mamba": kv_mamba_stack, "kv_dsa": kv_dsa_stack, "dsv4": dsv4_stack}


def fill_random(tensor: torch.Tensor, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes into ``tensor[:, slots]`` (a layer-major device component)."""
    view = tensor[:, slots]
    raw = torch.randint(0, 256, view.contiguous().view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
    tensor[:, slots] = raw.view(view.dtype).view(view.shape)


def snapshot(pool, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Bytes of every component of ``pool`` at ``slots``, all layers."""
    return {name: buf[:, slots].contiguous().view(torch.uint8).clone() for name, buf in pool.buffers.items()}


# ---- KV + Mamba through L3 ----------------------------------------------------------------
MAMBA_A = [3, 1, 4, 1]  # two pages of two tokens
MAMBA_AB = MAMBA_A + [5, 9, 2, 6]  # four pages
L3_DEADLINE_S = 20


class MambaL3Env:
    """A KV + Mamba stack on an L3 backend under ``tmp_path / backend`` and the steps of the
    Mamba L3 tests; ``coords``: CacheInitParams keyword arguments (TP rank, size, group)."""

    def __init__(self, tmp_path, backend="file", layout="layer_first", write_policy="write_through", seed=3,
                 **coords):
        config = HiCacheConfig(io_backend="direct", mem_layout=layout, write_policy=write_policy,
                               storage_backend=backend, model_name="tiny", prefetch_policy="wait_complete",
                               storage_backend_extra_config={"storage_dir": str(Path(tmp_path) / backend),
                                                             "prefetch_threshold": 2})
        self.stack = kv_mamba_stack(config, **coords)
        self.tree = self.stack.tree_cache
        self.controller = self.stack.cache_controller
        self.alloc = self.stack.params.token_to_kv_pool_allocator
        self.kv = self.alloc.get_kvcache()
        self.mamba = self.stack.host_pool_group.get_entry(PoolName.MAMBA).device_pool
        self.mamba_host = self.stack.host_pool_group.get_entry(PoolName.MAMBA).host_pool
        self.root = Path(tmp_path) / backend
        self.gen = torch.Generator().manual_seed(seed)

    def insert(self, tokens, with_state=True):
        """Cache ``tokens`` with random KV (and state); (KV bytes of the new slots, state bytes)."""
        slots = self.alloc.alloc(len(tokens))
        for buf in self.kv.buffers.values():
            fill_random(buf, slots, self.gen)
        kv_bytes, state, state_bytes = snapshot(self.kv, slots), None, None
        if with_state:
            state = self.mamba.alloc(1)
            for buf in self.mamba.buffers.values():
                fill_random(buf, state, self.gen)
            state_bytes = snapshot(self.mamba, state)
        prefix = self.tree.insert(InsertParams(key=RadixKey(tokens), value=slots, mamba_value=state)).prefix_len
        if prefix:
            self.alloc.free(slots[:prefix])
        return kv_bytes, state_bytes

    def settle(self):
        self.controller.synchronize()
        self.tree.storage.synchronize()
        self.tree.check_hicache_events()
        self.tree.storage.synchronize()
        self.tree.check_hicache_events()

    def flush(self):
        self.tree.reset()
        self.kv.clear()
        self.mamba.clear()

    def prefetch(self, tokens, node=None, rid="r") -> int:
        asked = self.tree.prefetch_from_storage(rid, node or self.tree.root_node, tokens)
        deadline = time.monotonic() + L3_DEADLINE_S
        while not self.tree.check_prefetch_progress(rid):
            assert time.monotonic() < deadline, "prefetch did not end"
            self.tree.check_hicache_events()
            time.sleep(0.005)
        return asked

    def load_back(self, tokens):
        """Match, load the host part back; (match, device slots of the whole hit, its end node)."""
        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        got = self.tree.init_load_back(m.last_host_node, m.host_hit_length)
        assert got is not None
        self.tree.ready_to_load_host_cache()
        self.settle()
        return m, torch.cat([m.device_indices, got]), m.last_host_node

    def l3(self):
        return self.controller.get_stats()["l3"]

    def state_file(self, page_hash):
        name = self.controller.storage_backend.codec(PoolName.MAMBA).object_names(page_hash)[0]
        found = [p for p in self.root.rglob(f"{name}*") if p.is_file()]
        assert len(found) == 1, f"expected one stored object for the state, found {found}"
        return found[0]

    def close(self):
        self.tree.reset()
        assert self.alloc.available_size() == self.alloc.size
        assert self.mamba.available_size() == self.mamba.size
        assert self.controller.mem_pool_host.available_size() == self.controller.mem_pool_host.size
        assert self.mamba_host.available_size() == self.mamba_host.size
        self.controller.close()


def mamba_l3_filled(tmp_path, **kwargs):
    """L3 holds AB (states after A and after AB); L1 and L2 are empty. Returns the env, the KV
    bytes of AB, the two states' bytes and AB's page hashes."""
    env = MambaL3Env(tmp_path, **kwargs)
    kv_a, state_a = env.insert(MAMBA_A)
    kv_b, state_b = env.insert(MAMBA_AB)
    env.settle()
    b = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(MAMBA_AB))).last_device_node
    hashes = b.parent.hash_value + b.hash_value
    env.flush()
    kv_ab = {c: torch.cat([kv_a[c], kv_b[c][:, len(MAMBA_A):]], dim=1) for c in kv_a}
    return env, kv_ab, state_a, state_b, hashes


def wait_for(cache, cond, what: str, deadline_s: float = 30.0) -> None:
    """Drive the tree's per-step checks (``check_hicache_events``) until ``cond()``; fail naming
    ``what`` after ``deadline_s`` (a bound on a hang, not a timing window)."""
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        cache.check_hicache_events()
        time.sleep(0.002)
