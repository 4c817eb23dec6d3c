"""Upstream's public surface at upstream's paths: every seed touch point (000-004) and the names
upstream's unit tests import resolve here with upstream's keywords, and every "same" row of
docs/upstream_compat.md that names an upstream path resolves in our package."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

DOC = Path(__file__).resolve().parents[4] / "docs" / "upstream_compat.md"

# (dotted name under sglang.srt, keywords its callable takes)
TOUCH_POINTS = [
    ("mem_cache.storage.nixl.hicache_nixl.HiCacheNixl.batch_set_v1", ()),
    ("mem_cache.storage.nixl.hicache_nixl.HiCacheNixl.batch_exists", ()),
    ("mem_cache.storage.nixl.hicache_nixl.HiCacheNixl.register_mem_host_pool_v2", ()),
    ("mem_cache.storage.nixl.hicache_nixl.HiCacheNixl.batch_get_v2", ()),
    ("mem_cache.storage.nixl.hicache_nixl.HiCacheNixl", ("storage_config", "file_path")),
    ("mem_cache.pool_host.mamba.MambaPoolHost.is_stride_page_aligned", ("page_size_bytes",)),
    ("mem_cache.pool_host.dsa.DSAIndexerPoolHost.is_stride_page_aligned", ("page_size_bytes",)),
    ("mem_cache.memory_pool_host.DeepSeekV4StateHostPool.is_stride_page_aligned", ("page_size_bytes",)),
    ("mem_cache.pool_host.group.HostPoolGroup.is_stride_page_aligned", ("page_size_bytes",)),
    ("mem_cache.pool_host.base.HostKVCache.is_stride_page_aligned", ("page_size_bytes",)),
    ("disaggregation.nixl.conn.NixlKVManager.send_kvcache_slice", ("peer_name", "prefill_kv_indices", "dst_kv_indices")),
    ("disaggregation.nixl.conn.TransferStatus.is_done", ()),
    ("mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController",
     ("pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")),
    ("mem_cache.hybrid_cache.hybrid_pool_assembler.build_mamba_hybrid_stack", ()),
    ("mem_cache.hybrid_cache.hybrid_pool_assembler.build_nsa_hybrid_stack", ()),
    ("mem_cache.pool_host.mha.AsymmetricMHATokenToKVPoolHost.init_kv_buffer", ()),
    ("mem_cache.pool_host.mha.AsymmetricMHATokenToKVPoolHost.load_to_device_per_layer", ()),
    ("mem_cache.pool_host.mha.AsymmetricMHATokenToKVPoolHost.backup_from_device_all_layer", ()),
    ("managers.cache_controller.HiCacheController",
     ("token_to_kv_pool_allocator", "mem_pool_host", "page_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")),
    ("mem_cache.hicache_storage.HiCacheStorageConfig",
     ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "is_mla_model",
      "enable_storage_metrics", "is_page_first_layout", "model_name", "extra_config")),
    ("mem_cache.hicache_storage.HiCacheFile", ("storage_config", "file_path")),
    ("mem_cache.base_prefix_cache.MatchPrefixParams", ("key",)),
    ("mem_cache.base_prefix_cache.InsertParams", ("key", "value")),
    ("mem_cache.base_prefix_cache.EvictParams", ("num_tokens",)),
    ("mem_cache.base_prefix_cache.EvictResult", ()),
    ("mem_cache.allocator.TokenToKVPoolAllocator", ()),
    ("mem_cache.radix.tree_node.TreeNode", ("id",)),
    ("disaggregation.kv_events.BlockStored", ()),
    ("disaggregation.kv_events.BlockRemoved", ()),
    ("disaggregation.kv_events.AllBlocksCleared", ()),
    ("mem_cache.storage.nixl.nixl_routing.route_key", ()),
    ("mem_cache.storage.nixl.nixl_utils.NixlFileManager", ()),
    ("mem_cache.pool_host.mha.get_mha_host_pool_cls", ()),
]


def resolve(dotted: str):
    """The object at ``dotted`` (a module path, then attributes); AttributeError/ImportError if absent."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name, keywords", TOUCH_POINTS, ids=[n for n, _ in TOUCH_POINTS])
def test_seed_touch_points_are_at_upstreams_paths_with_upstreams_keywords(name, keywords):
    obj = resolve(f"sglang.srt.{name}")
    assert callable(obj)
    params = inspect.signature(obj).parameters
    assert [k for k in keywords if k not in params] == []


def same_rows_with_upstream_paths() -> list[str]:
    names = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[2].startswith("same"):
            continue
        m = re.match(r"`((?:mem_cache|managers|disaggregation)\.[A-Za-z_.]+)", cells[0])
        if m:
            names.append(m.group(1).rstrip("."))
    return names


def test_the_compat_table_names_upstream_paths_and_every_same_row_resolves():
    names = same_rows_with_upstream_paths()
    assert len(names) >= 5  # the table is parsed (a reformatted table must not pass vacuously)
    missing = []
    for name in names:
        try:
            resolve(f"sglang.srt.{name}")
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []
