"""Storage keys: pages that could hold different bytes never share an object name."""

import pytest
import torch
from conftest import host_pool, page_keys, slots, storage_config

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.group import PoolName
from sglang.srt.mem_cache.storage.pool_codec import PoolCodec
from sglang.srt.mem_cache.storage.keys import KeyDeriver, StorageNamespace, check_key, key_bytes
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

KEY = page_keys(1)[0]


def names(host, pool=PoolName.KV, per_component=True, key=KEY, **cfg):
    config = storage_config(host, cfg.pop("extra", None), **cfg)
    ns = StorageNamespace.for_pool(config, host, pool.value, "fmt")
    return PoolCodec(pool, host, ns, per_component).object_names(key)


@pytest.fixture(scope="module")
def mha():
    return host_pool(PoolKind.MHA, "page_first_direct")


@pytest.fixture(scope="module")
def mla():
    return host_pool(PoolKind.MLA, "page_first_direct")


def test_names_are_hex_digest_plus_fixed_suffix(mha, mla):
    k, v = names(mha)
    assert k[:64] == v[:64] and len(k) == 66 and k.endswith("_k") and v.endswith("_v")
    assert int(k[:64], 16) >= 0
    assert names(mla)[0].endswith("_k") and len(names(mla)) == 1
    mamba = host_pool(PoolKind.MAMBA, "page_first_direct")
    assert [n[64:] for n in names(mamba, PoolName.MAMBA)] == ["_mamba_temporal", "_mamba_conv_0", "_mamba_conv_1"]
    dsa = host_pool(PoolKind.DSA_INDEXER, "page_first_direct")
    assert [n[64:] for n in names(dsa, PoolName.INDEXER)] == ["_indexer_k", "_indexer_v"]
    anchor = host_pool(PoolKind.DSV4_ANCHOR, "page_first_direct")
    assert [n[64:] for n in names(anchor)] == ["_marker"]


def test_differ_by_model_dtype_page_size_format_and_salt(mha):
    base = names(mha)
    assert names(mha, model="other-model") != base
    assert names(host_pool(PoolKind.MHA, "page_first_direct", dtype=torch.float16)) != base
    assert names(host_pool(PoolKind.MHA, "page_first_direct", page_size=8)) != base
    assert names(host_pool(PoolKind.MHA, "page_first")) != base  # PLI bytes, not LPI
    assert names(host_pool(PoolKind.MHA, "page_first_direct", head_dim=16)) != base
    assert names(mha, key=page_keys(1, salt="tenant-b")[0]) != base  # tenant salt seeds the chain
    assert names(mha, extra={"namespace_salt": "deployment-2"}) != base


def test_layouts_with_one_byte_format_share_keys(mha):
    """layer_first and page_first_direct produce the same flat-page bytes, so they share L3."""
    assert names(host_pool(PoolKind.MHA, "layer_first")) == names(mha)


def test_shard_coordinates(mha, mla):
    base = names(mha, tp_rank=0, tp_size=2)
    assert names(mha, tp_rank=1, tp_size=2) != base
    assert names(mha, tp_rank=0, tp_size=4) != base
    assert names(mha, pp_rank=1, pp_size=2) != names(mha, pp_rank=0, pp_size=2)
    assert names(mha, attn_cp_rank=1, attn_cp_size=2) != names(mha, attn_cp_rank=0, attn_cp_size=2)
    # MLA: the latent is the same on every TP rank, so every rank names it the same ...
    assert names(mla, tp_rank=0, tp_size=2) == names(mla, tp_rank=1, tp_size=2) == names(mla, tp_rank=3, tp_size=4)
    # ... but PP stages and CP ranks still hold different bytes.
    assert names(mla, pp_rank=1, pp_size=2) != names(mla, pp_rank=0, pp_size=2)
    assert names(mla, attn_cp_rank=1, attn_cp_size=2) != names(mla, attn_cp_rank=0, attn_cp_size=2)
    # A rank-sharded side pool of an MLA model keeps its TP coordinates.
    mamba = host_pool(PoolKind.MAMBA, "page_first_direct")
    assert names(mamba, PoolName.MAMBA, tp_rank=0, tp_size=2) != names(mamba, PoolName.MAMBA, tp_rank=1, tp_size=2)


def test_request_data_never_reaches_a_path():
    for bad in ["", None, 7, b"00"]:
        with pytest.raises(ValueError, match="non-empty string"):
            check_key(bad)
    ns = StorageNamespace("m", "kv", "f", "bf16", 4, "0/1", "0/1", "0/1", "fmt")
    assert KeyDeriver(ns).stem("0" * 64) != "0" * 64
    # any other string is a key of its own, hashed like a page hash: a name is always 64 hex digits
    for key in ["../" * 10 + "etc/passwd", "A" * 64, "0" * 63, "h0", "é/\\0"]:
        stem = KeyDeriver(ns).stem(key)
        assert len(stem) == 64 and int(stem, 16) >= 0
    # a page hash and the text of its hex digits never collide; upper case is text, not a hash
    assert key_bytes("ab" * 32) == bytes.fromhex("ab" * 32)
    assert len({key_bytes("ab" * 32), key_bytes("AB" * 32), key_bytes("ab" * 31)}) == 3


def test_config_comes_from_cache_params_and_pool(mla):
    params = CacheInitParams(page_size=4, tp_rank=1, tp_size=2, pp_rank=1, pp_size=3, attn_cp_rank=0, attn_cp_size=2)
    cfg = HiCacheStorageConfig.from_cache_params(params, mla, "m", '{"namespace_salt": "x"}')
    assert (cfg.tp_rank, cfg.tp_size, cfg.pp_rank, cfg.pp_size, cfg.attn_cp_size) == (1, 2, 1, 3, 2)
    assert cfg.is_mla_model and cfg.page_size == 4 and cfg.kv_dtype == "bfloat16"
    assert cfg.page_format == mla.page_format and cfg.namespace_salt == "x"
    with pytest.raises(ValueError, match="extra_config is not valid JSON"):
        HiCacheStorageConfig.from_cache_params(params, mla, "m", "{not json")
    with pytest.raises(ValueError, match="namespace_salt"):
        HiCacheStorageConfig.from_cache_params(params, mla, "m", {"namespace_salt": 3})
    with pytest.raises(ValueError, match="model_name"):
        HiCacheStorageConfig.from_cache_params(params, mla, "", None)
    with pytest.raises(ValueError, match="tp_rank"):
        HiCacheStorageConfig(model_name="m", tp_rank=2, tp_size=2)


def test_extra_backend_tag_is_a_tenant_namespace(mha, make_backend):
    """Upstream's ``extra_backend_tag``: servers with different tags sharing one store never read
    each other's pages; the same tag does; a non-string tag is refused naming the key."""
    base = names(mha)
    tagged = names(mha, extra={"extra_backend_tag": "tenant-a"})
    assert tagged not in (base, names(mha, extra={"extra_backend_tag": "b"}))
    assert names(mha, extra={"extra_backend_tag": ""}) == base  # no tag: the untagged names
    host = host_pool(PoolKind.MHA, "page_first_direct")
    keys = page_keys(3)
    writer = make_backend("file", host, {"extra_backend_tag": "tenant-a"}, share="l3")
    assert writer.batch_set_v1(keys, slots(host, 0, 3)) == [True] * 3
    assert make_backend("file", host, {"extra_backend_tag": "tenant-b"}, share="l3").batch_exists(keys) == 0
    assert make_backend("file", host, share="l3").batch_exists(keys) == 0
    assert make_backend("file", host, {"extra_backend_tag": "tenant-a"}, share="l3").batch_exists(keys) == 3
    with pytest.raises(ValueError, match="'extra_backend_tag' must be a string"):
        storage_config(host, {"extra_backend_tag": 7})
