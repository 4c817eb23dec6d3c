"""The L3 hookup takes the server's flags as they are and refuses bad ones at construction with
an error naming the field or key: HiCacheConfig's storage fields, the controller's extra config
keys, the backend's own keys, unknown backends, a storage backend with a Mamba tree."""

import json

import pytest
from tree_fixtures import make_hicache

from sglang.srt.mem_cache.controller.hicache_config import HiCacheConfig, PrefetchPolicy
from sglang.srt.mem_cache.controller.storage_settings import StorageSettings, split_extra_config
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(storage_backend="s3", model_name="m"),
         "storage_backend 's3' is not allowed; allowed: dynamic, file, mooncake, nixl"),
        (dict(storage_backend="file"), "model_name must be a non-empty string when storage_backend is set"),
        (dict(storage_backend_extra_config={"a": 1}),
         "storage_backend_extra_config is set but storage_backend is None"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config="{oops"),
         "storage_backend_extra_config is not valid JSON"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config="[1, 2]"),
         "storage_backend_extra_config must be a JSON object"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config={"prefetch_threshold": "lots"}),
         "key 'prefetch_threshold' must be a number, got 'lots'"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config={"prefetch_threshold": 2.5}),
         "key 'prefetch_threshold' must be an integer"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config={"prefetch_timeout_base": -1}),
         "key 'prefetch_timeout_base' must be >= 0.0"),
        (dict(storage_backend="file", model_name="m", storage_backend_extra_config={"prefetch_timeout_max": 0}),
         "key 'prefetch_timeout_max' must be > 0.0"),
        (dict(prefetch_policy="sometimes"),
         "unknown prefetch_policy 'sometimes'; allowed: best_effort, wait_complete, timeout"),
    ],
)
def test_hicache_config_refuses_bad_storage_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(**kwargs)


def test_server_flags_pass_straight_through(tmp_path):
    extra = json.dumps({"storage_dir": str(tmp_path), "prefetch_threshold": 64, "prefetch_timeout_base": 2})
    cfg = HiCacheConfig(storage_backend="file", storage_backend_extra_config=extra, model_name="m",
                        prefetch_policy="best_effort")
    assert cfg.prefetch_policy is PrefetchPolicy.BEST_EFFORT
    h = make_hicache(page_size=2, storage=cfg.storage_kwargs, prefetch_policy=cfg.prefetch_policy)
    controller = h.cache_controller
    assert controller.storage.settings == StorageSettings(prefetch_threshold=64, prefetch_timeout_base=2.0)
    assert controller.storage_backend.file_path == str(tmp_path)
    assert "prefetch_threshold" not in controller.storage_config.extra_config  # the controller's, not the backend's
    assert h.prefetch_stop_policy is PrefetchPolicy.BEST_EFFORT
    controller.close()
    controller.close()  # idempotent


def test_defaults_are_documented_values():
    assert split_extra_config({"storage_dir": "/x"}) == (StorageSettings(256, 1.0, 0.25, 30.0), {"storage_dir": "/x"})
    assert HiCacheConfig().prefetch_policy is PrefetchPolicy.TIMEOUT  # upstream 0.5.23's default


@pytest.mark.parametrize(
    "storage, message",
    [
        ({"storage_backend": "nope", "model_name": "m"}, "unknown storage backend 'nope'; known: dynamic, file, mooncake, nixl"),
        ({"storage_backend": "file", "model_name": "m", "storage_backend_extra_config": {"bogus_key": 1}},
         "unknown extra config key 'bogus_key'"),
        ({"storage_backend": "file", "model_name": ""}, "model_name must be a non-empty string"),
        ({"storage_backend": "dynamic", "model_name": "m", "storage_backend_extra_config": {"module_path": "x"}},
         "needs extra config keys module_path and class_name"),
    ],
)
def test_controller_refuses_a_bad_hookup_at_construction(storage, message):
    with pytest.raises(ValueError, match=message):
        make_hicache(page_size=2, storage=storage)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
