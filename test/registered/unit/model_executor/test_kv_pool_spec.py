"""Models state their cache (KVPoolLayout); the runner builds device pools from a pool-kind table
and the cache factory maps pool kinds to host pools and hybrid stacks, refusing host cells a pool
kind cannot honour with the supported cells named."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.cache_factory import HYBRID_STACK_BUILDERS, build_tree_cache, check_host_cells
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import ANCHOR_HOST_CLASSES
from sglang.srt.mem_cache.kvcacheio.dispatch import supported_cells
from sglang.srt.mem_cache.memory_pool.base import PoolKind
from sglang.srt.mem_cache.memory_pool.mha import AsymmetricMHATokenToKVPool, MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool.mla import MLATokenToKVPool
from sglang.srt.model_executor.kv_pool_spec import (
    DEVICE_POOL_CLASSES,
    SIDECAR_KINDS,
    STATE_KINDS,
    KVPoolLayout,
    PoolSpec,
    mha_layout,
)
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}


def test_every_pool_kind_has_a_device_class_and_a_role():
    assert set(DEVICE_POOL_CLASSES) == set(PoolKind)
    anchors = set(PoolKind) - set(SIDECAR_KINDS) - set(STATE_KINDS)
    assert anchors == set(ANCHOR_HOST_CLASSES), "every anchor kind needs a host pool class"
    assert set(HYBRID_STACK_BUILDERS) == set(SIDECAR_KINDS) | set(STATE_KINDS)


def test_mha_layout_picks_symmetric_or_asymmetric_pool():
    sym = mha_layout(torch.float32, 3, 2, 16).anchor.build(32, 16, "cpu")
    assert type(sym) is MHATokenToKVPool and sym.size == 32 and sym.layer_num == 3
    asym = mha_layout(torch.float32, 3, 2, 16, v_head_dim=8).anchor.build(32, 16, "cpu")
    assert type(asym) is AsymmetricMHATokenToKVPool and asym.v_head_dim == 8


def test_bytes_per_token_counts_anchor_and_sidecars():
    mla = PoolSpec(PoolKind.MLA, {"dtype": torch.bfloat16, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "layer_num": 2})
    dsa = PoolSpec(PoolKind.DSA_INDEXER, {"index_head_dim": 16, "layer_num": 2, "dtype": torch.bfloat16})
    assert KVPoolLayout(mla).bytes_per_token(16) == 2 * 40 * 2
    assert KVPoolLayout(mla, (dsa,)).bytes_per_token(16) == 2 * 40 * 2 + 2 * (16 * 2 + 4)


def test_layout_refuses_pools_in_the_wrong_role():
    mha = mha_layout(torch.float32, 1, 1, 8).anchor
    dsa = PoolSpec(PoolKind.DSA_INDEXER, {"index_head_dim": 8, "layer_num": 1})
    with pytest.raises(ValueError, match="dsa_indexer cannot be an anchor"):
        KVPoolLayout(dsa)
    with pytest.raises(ValueError, match="mha cannot be a sidecar; sidecar kinds"):
        KVPoolLayout(mha, (mha,))
    with pytest.raises(ValueError, match="dsa_indexer cannot be a state pool"):
        KVPoolLayout(mha, (), dsa)


def test_model_class_states_llama_layout_per_tp_rank():
    mc = ModelConfig.from_dict(LLAMA)
    layout = mc.kv_pool_layout(tp_size=1)
    assert layout.anchor.kind is PoolKind.MHA and layout.anchor.args["head_num"] == 2
    assert mc.kv_pool_layout(tp_size=2).anchor.args["head_num"] == 1
    assert mc.kv_pool_layout(tp_size=4).anchor.args["head_num"] == 1  # replicated KV heads
    assert layout.anchor.args["head_dim"] == 16 and not layout.sidecars and layout.state is None


def test_missing_required_key_is_named():
    raw = {k: v for k, v in LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"lacks required fields \['intermediate_size'\] for LlamaForCausalLM"):
        ModelConfig.from_dict(raw, "/ckpt")


def _runner(pool):
    return SimpleNamespace(token_to_kv_pool=pool, side_pools={}, state_pool=None, all_pools=[pool])


@pytest.mark.parametrize("pool_kind", [PoolKind.MHA, PoolKind.MLA, PoolKind.ASYMMETRIC_MHA])
def test_host_cells_follow_the_pool_kind(pool_kind):
    if pool_kind is PoolKind.MLA:
        pool = MLATokenToKVPool(32, 16, torch.float32, 8, 4, 1)
    else:
        pool = mha_layout(torch.float32, 1, 1, 8, 4 if pool_kind is PoolKind.ASYMMETRIC_MHA else None).anchor.build(
            32, 16, "cpu")
    cells = supported_cells(pool_kind)
    for layout, io in cells:
        check_host_cells(ServerArgs(model_path="/m", enable_hierarchical_cache=True, hicache_mem_layout=layout,
                                    hicache_io_backend=io), _runner(pool))
    args = ServerArgs(model_path="/m", enable_hierarchical_cache=True, hicache_mem_layout="page_head",
                      hicache_io_backend="kernel")
    if ("page_head", "kernel") in cells:
        check_host_cells(args, _runner(pool))
    else:
        with pytest.raises(ValueError, match=f"not supported by this model's {pool_kind.value} pool.*supported "
                                             "layout\\+io_backend: layer_first\\+direct"):
            check_host_cells(args, _runner(pool))


def test_state_model_without_hicache_gets_a_mamba_radix_cache(monkeypatch):
    """Issue 28: the default invocation of a state model starts, with upstream's device-only
    MambaRadixCache (the scheduler-level hits are in test_qwen3_next*.py)."""
    from sglang.srt.managers import cache_factory
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    pool = mha_layout(torch.float32, 1, 1, 8).anchor.build(32, 16, "cpu")
    runner = _runner(pool)
    runner.state_pool = SimpleNamespace(kind=PoolKind.MAMBA, size=4)
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    alloc = PagedTokenToKVPoolAllocator(32, 16, kvcache=pool)
    monkeypatch.setattr(cache_factory, "cache_init_params",
                        lambda args, r: CacheInitParams(page_size=16, token_to_kv_pool_allocator=alloc))
    tree = build_tree_cache(ServerArgs(model_path="/m"), runner)
    assert type(tree) is MambaRadixCache and tree.mamba_pool is runner.state_pool and tree.supports_mamba()
