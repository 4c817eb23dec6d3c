"""CacheInitParams is the one source of tp/pp/attention-cp coordinates: every hybrid stack built
with pp_rank=1/2, attn_cp_rank=1/2, tp_rank=1/2 carries exactly those in its controller, its tree
and the storage config derived from the controller (also the one the controller itself builds
for its L3 backend); validation names the bad field."""

import pytest
from tree_fixtures import STACKS, make_hicache

from sglang.srt.mem_cache.cache_init_params import CacheInitParams, ParallelCoords
from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

COORDS = dict(pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=2, tp_rank=1, tp_size=2)


@pytest.mark.parametrize("stack_name", sorted(STACKS))
def test_every_hybrid_stack_carries_exactly_the_params_coordinates(stack_name):
    stack = STACKS[stack_name](**COORDS)
    expected = ParallelCoords(**COORDS)
    assert stack.cache_controller.parallel_coords() == expected
    assert stack.parallel_coords() == expected
    assert stack.tree_cache.params is stack.params
    stack.params.check_same_cache(stack.cache_controller.params)  # the controller's, built from its keywords
    storage = HiCacheStorageConfig.from_cache_params(
        stack.cache_controller.parallel_coords(), stack.host_pool_group, model_name="tiny-model"
    )
    for field, value in COORDS.items():
        assert getattr(storage, field) == value, field
    stack.cache_controller.close()


def test_plain_controller_reads_coordinates_from_params_only():
    h = make_hicache(page_size=2, **COORDS)
    assert h.cache_controller.parallel_coords() == ParallelCoords(**COORDS)
    h.cache_controller.close()


def _storage_config_of(controller):
    config = controller.storage_config
    assert config is controller.storage_backend.config  # the backend got exactly this config
    return config


@pytest.mark.parametrize("stack_name", ["kv_dsa", "dsv4"])
def test_storage_config_built_by_a_hybrid_controller_carries_exactly_the_coordinates(tmp_path, stack_name):
    config = HiCacheConfig(io_backend="direct", storage_backend="file", model_name="tiny-model",
                           storage_backend_extra_config={"storage_dir": str(tmp_path)})
    stack = STACKS[stack_name](config, **COORDS)
    storage = _storage_config_of(stack.cache_controller)
    assert {f: getattr(storage, f) for f in COORDS} == COORDS
    stack.cache_controller.close()


def test_storage_config_built_by_the_plain_controller_carries_exactly_the_coordinates(tmp_path):
    store = {"storage_backend": "file", "model_name": "tiny-model",
             "storage_backend_extra_config": {"storage_dir": str(tmp_path)}}
    h = make_hicache(page_size=2, storage=store, **COORDS)
    storage = _storage_config_of(h.cache_controller)
    assert {f: getattr(storage, f) for f in COORDS} == COORDS
    h.cache_controller.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp_rank=2, pp_size=2), r"pp_rank must be in \[0, pp_size=2\), got 2"),
        (dict(attn_cp_size=0), "attn_cp_size must be >= 1, got 0"),
        (dict(tp_rank=-1), r"tp_rank must be in \[0, tp_size=1\), got -1"),
        (dict(page_size=0), "page_size must be >= 1, got 0"),
        (dict(eviction_policy="mru"), "allowed: lru, lfu"),
    ],
)
def test_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheInitParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(write_policy="write_later"), "unknown write policy 'write_later'"),
        (dict(hicache_ratio=0), "hicache_ratio must be > 0"),
        (dict(hicache_size_gb=-1), "hicache_size_gb must be >= 0"),
        (dict(mem_layout="diagonal"), "unknown host layout 'diagonal'"),
        (dict(io_backend="dma"), "unknown io_backend 'dma'"),
        (dict(load_back_threshold=-3), "load_back_threshold must be >= 0"),
    ],
)
def test_hicache_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(**kwargs)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
