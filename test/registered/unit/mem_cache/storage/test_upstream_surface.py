"""hicache_storage's upstream surface: HiCacheStorageConfig built from upstream's keywords (and
still validated), HiCacheFile(config, file_path=) where upstream has it, its directory's
precedence, the page format checked against the KV pool only when the config states it, the
factory's span support, and get_hash_str over this fork's page-hash chain."""

import pytest
import torch
from conftest import fill_random, host_pool, page_keys, slots

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

UPSTREAM_KEYWORDS = dict(
    tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
    enable_storage_metrics=True, is_page_first_layout=True, model_name="org/model", extra_config=None,
)


def test_config_takes_upstreams_keywords_and_defaults_the_rest():
    cfg = HiCacheStorageConfig(**UPSTREAM_KEYWORDS)
    assert (cfg.tp_rank, cfg.tp_size, cfg.enable_storage_metrics, cfg.is_page_first_layout) == (1, 2, True, True)
    assert cfg.extra_config == {} and cfg.namespace_salt == ""  # None means no extra config
    assert (cfg.kv_dtype, cfg.page_size, cfg.page_format, cfg.storage_page_size) == (None, None, None, None)
    assert (cfg.dp_rank, cfg.dcp_size, cfg.dcp_rank, cfg.tp_lcm_size, cfg.should_split_heads) == (0, 1, 0, None, False)
    assert cfg.is_storage_writer
    mla = HiCacheStorageConfig(**{**UPSTREAM_KEYWORDS, "is_mla_model": True})
    assert not mla.is_storage_writer  # TP rank 1 of an MLA model: rank 0 writes for it
    assert HiCacheStorageConfig(model_name="m", extra_config={"namespace_salt": "d2"}).namespace_salt == "d2"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_name=None), "model_name must be a non-empty string, got None"),
        (dict(tp_rank=2), r"tp_rank must be in \[0, tp_size=2\), got 2"),
        (dict(is_mla_model="yes"), "is_mla_model must be a bool, got 'yes'"),
        (dict(dp_rank=-1), "dp_rank must be an int >= 0, got -1"),
        (dict(dcp_size=2), "dcp_size=2: decode context parallelism is not supported.*allowed: 1"),
        (dict(should_split_heads=True), "should_split_heads=True: .*allowed: False"),
        (dict(tp_lcm_size=4), r"tp_lcm_size=4: heterogeneous-TP storage is not supported; allowed: None or tp_size \(2\)"),
        (dict(storage_page_size=0), "storage_page_size must be None or an int >= 1, got 0"),
        (dict(extra_config=[1]), "extra_config must be a dict, got list"),
        (dict(extra_config={"namespace_salt": 3}), "'namespace_salt' must be a string, got 3"),
    ],
)
def test_config_refuses_what_it_cannot_honour(change, message):
    with pytest.raises(ValueError, match=message):
        HiCacheStorageConfig(**{**UPSTREAM_KEYWORDS, **change})
    assert HiCacheStorageConfig(**{**UPSTREAM_KEYWORDS, "tp_lcm_size": 2}).tp_lcm_size == 2  # = tp_size: no split


def test_from_cache_params_states_the_pool_and_registration_checks_it(tmp_path):
    mha = host_pool(PoolKind.MHA, "page_first")
    cfg = HiCacheStorageConfig.from_cache_params(CacheInitParams(page_size=4), mha, "m", {"storage_dir": str(tmp_path)})
    assert (cfg.page_size, cfg.kv_dtype, cfg.page_format, cfg.is_page_first_layout) == (4, "bfloat16", mha.page_format, True)
    other = host_pool(PoolKind.MHA, "page_first", dtype=torch.float16)
    store = HiCacheFile(cfg)
    with pytest.raises(ValueError, match="host pool page_format .* differs from the storage config's"):
        store.register_mem_pool_host(other)
    store.register_mem_pool_host(mha)
    store.close()
    # a config that states nothing about the format takes any pool
    loose = HiCacheFile(HiCacheStorageConfig(model_name="m"), file_path=str(tmp_path / "loose"))
    loose.register_mem_pool_host(other)
    loose.close()


def directory_of(config, file_path=None) -> str:
    store = HiCacheFile(config, file_path=file_path)
    store.close()
    return store.file_path


def test_hicache_file_directory_precedence(tmp_path, monkeypatch):
    """extra config storage_dir (or upstream's file_storage_path) > environment > file_path."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = HiCacheStorageConfig(model_name="m")
    assert directory_of(cfg, str(tmp_path / "arg")) == str(tmp_path / "arg")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "env"))
    assert directory_of(cfg, str(tmp_path / "arg")) == str(tmp_path / "env")
    for key in ("storage_dir", "file_storage_path"):
        extra = HiCacheStorageConfig(model_name="m", extra_config={key: str(tmp_path / key)})
        assert directory_of(extra, str(tmp_path / "arg")) == str(tmp_path / key)
    both = HiCacheStorageConfig(model_name="m", extra_config={"storage_dir": "a", "file_storage_path": "b"})
    with pytest.raises(ValueError, match="'file_storage_path' and 'storage_dir' are the same setting"):
        HiCacheFile(both)


def test_factory_builds_then_registers_and_knows_span_backends(tmp_path):
    mha = host_pool(PoolKind.MHA, "page_first_direct")
    fill_random(mha, seed=5)
    assert StorageBackendFactory.backend_supports_page_spans("file")
    assert StorageBackendFactory.backend_supports_page_spans("nixl")
    assert not StorageBackendFactory.backend_supports_page_spans("dynamic")
    assert not StorageBackendFactory.backend_supports_page_spans("no-such-backend")
    extra = {"storage_dir": str(tmp_path), "module_path": "x", "class_name": "Y"}
    spanned = HiCacheStorageConfig(model_name="m", storage_page_size=8, extra_config=extra)
    with pytest.raises(ValueError, match="backend 'dynamic' does not support storage_page_size; backends that do: "
                                         "file, nixl"):
        StorageBackendFactory.create_backend("dynamic", spanned, mha)
    cfg = HiCacheStorageConfig(model_name="m", storage_page_size=8, extra_config={"storage_dir": str(tmp_path)})
    store = StorageBackendFactory.create_backend("file", cfg, mha)
    keys = page_keys(2)
    assert store.batch_set_v1(keys, slots(mha, 0, 4)) == [True, True]  # two keys of two 4-token pages each
    store.close()


def test_get_hash_str_is_the_page_hash_chain():
    tokens = list(range(40, 52))
    hashes = get_hash_str(tokens, None, page_size=4)
    assert hashes == page_hashes(tokens, 4, namespace_hash())  # None: the default namespace's seed
    assert get_hash_str(tokens[4:8], hashes[0], page_size=4) == [hashes[1]]  # chains from a prior page
    assert get_hash_str(tokens[:4]) == hashes[0]  # no page size: the whole list is one page, a string
    assert get_hash_str(tokens[:6], None, page_size=4) == hashes[:1]  # a partial page is not hashed
