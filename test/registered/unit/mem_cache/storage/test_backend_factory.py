"""StorageBackendFactory, extra config validation, and the fault guard (a backend that raises)."""

import pytest
from conftest import fill_random, host_pool, page_keys, slots, storage_config

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")


class FaultyFile(HiCacheFile):
    """A file backend whose I/O raises after construction, as a broken backend would."""

    def _exists_objects(self, codec, names):
        raise RuntimeError("disk on fire")

    def _read_pages(self, pages):
        raise TimeoutError("backend timed out")

    def _write_pages(self, pages):
        raise OSError(5, "Input/output error")


class NotAStorage:
    def __init__(self, *args):
        pass


@pytest.fixture(scope="module")
def mha():
    host = host_pool(PoolKind.MHA)
    fill_random(host)
    return host


def test_known_names_and_lazy_classes(mha, tmp_path):
    assert StorageBackendFactory.known_backends() == ["dynamic", "file", "mooncake", "nixl"]
    cfg = storage_config(mha, {"storage_dir": str(tmp_path)})
    store = StorageBackendFactory.create_backend("file", cfg, mha)
    assert isinstance(store, HiCacheFile) and isinstance(store, HiCacheStorage)
    store.close()


def test_unknown_or_broken_backends_name_the_known_ones(mha, tmp_path):
    cfg = storage_config(mha, {"storage_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="unknown storage backend 'hf3fs'; known: dynamic, file, mooncake, nixl"):
        StorageBackendFactory.create_backend("hf3fs", cfg, mha)
    bad_import = storage_config(mha, {"module_path": "no.such.module", "class_name": "X"})
    with pytest.raises(ValueError, match="cannot load no.such.module:X.*known: dynamic, file, mooncake, nixl"):
        StorageBackendFactory.create_backend("dynamic", bad_import, mha)
    wrong_type = storage_config(mha, {"module_path": __name__, "class_name": "NotAStorage"})
    with pytest.raises(ValueError, match="not a HiCacheStorage subclass"):
        StorageBackendFactory.create_backend("dynamic", wrong_type, mha)
    with pytest.raises(ValueError, match="module_path and class_name"):
        StorageBackendFactory.create_backend("dynamic", storage_config(mha, {"class_name": "X"}), mha)
    with pytest.raises(ValueError, match="already registered"):
        StorageBackendFactory.register_backend("file", "x:Y")


def test_dynamic_backend_is_built_with_the_common_signature(mha, tmp_path):
    extra = {"module_path": __name__, "class_name": "FaultyFile", "storage_dir": str(tmp_path)}
    store = StorageBackendFactory.create_backend("dynamic", storage_config(mha, extra), mha)
    assert type(store).__name__ == "FaultyFile" and store.codecs
    store.close()


def test_a_backend_that_raises_is_a_counted_failure_and_a_miss(mha, tmp_path):
    extra = {"module_path": __name__, "class_name": "FaultyFile", "storage_dir": str(tmp_path)}
    store = StorageBackendFactory.create_backend("dynamic", storage_config(mha, extra), mha)
    keys = page_keys(2)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, slots(mha, 0, 2)) == [False, False]
    assert store.batch_get_v1(keys, slots(mha, 8, 2)) == [False, False]
    stats = store.get_stats()
    assert stats["failures"] == 3 and stats["pages_missed"] == 2
    store.close()


def test_real_io_fault_in_the_file_backend(mha, tmp_path):
    """A bucket directory replaced by a file fails the write, not the caller."""
    store = StorageBackendFactory.create_backend("file", storage_config(mha, {"storage_dir": str(tmp_path)}), mha)
    key = page_keys(1)
    bucket = tmp_path / store.codecs[next(iter(store.codecs))].object_names(key[0])[0][:2]
    bucket.rmdir()
    bucket.write_bytes(b"x")
    assert store.batch_set_v1(key, slots(mha, 0, 1)) == [False]
    assert store.get_stats()["failures"] == 1
    assert store.batch_get_v1(key, slots(mha, 8, 1)) == [False]
    store.close()


@pytest.mark.parametrize(
    "backend,extra,match",
    [
        ("file", {"storage_dirr": "/tmp/x"}, "unknown extra config key 'storage_dirr'; allowed: .*storage_dir"),
        ("file", {"capacity_gb": "lots"}, "'capacity_gb' must be float"),
        ("file", {"capacity_gb": -1}, "'capacity_gb' must be >= 0"),
        ("file", {"io_threads": 0}, "'io_threads' must be >= 1"),
        ("file", {"io_threads": "many"}, "'io_threads' must be int"),
        ("nixl", {"plugin": "gds"}, "'plugin' is 'gds'; allowed: posix, obj"),
        ("nixl", {"plugin": {"posix": {"active": False}}}, "'plugin' has no entry marked"),
        ("nixl", {"plugin": "obj"}, "'plugin_params.bucket'"),
        ("nixl", {"use_direct_io": "sometimes"}, "'use_direct_io' must be a boolean"),
        ("nixl", {"bounce_pages": 0}, "'bounce_pages' must be >= 1"),
        ("nixl", {"plugin_params": {"use_uring": ["x"]}}, "'plugin_params.use_uring' must be a string"),
        ("nixl", {"plugin_params": {"no_such_knob": "1"}}, "'plugin_params.no_such_knob' for POSIX; allowed:"),
        ("nixl", {"plugin_params": "posix"}, "'plugin_params' must be an object"),
    ],
)
def test_malformed_extra_config_is_refused_naming_the_key(mha, tmp_path, backend, extra, match, monkeypatch):
    monkeypatch.delenv("AWS_DEFAULT_BUCKET", raising=False)
    cfg = storage_config(mha, {"storage_dir": str(tmp_path), **extra})
    with pytest.raises(ValueError, match=match):
        StorageBackendFactory.create_backend(backend, cfg, mha)


def test_nested_plugin_form_and_environment(mha, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_USE_DIRECT_IO", "false")
    extra = {"storage_dir": str(tmp_path), "plugin": {"obj": {"bucket": "b"}, "posix": {"active": True}}}
    store = StorageBackendFactory.create_backend("nixl", storage_config(mha, extra), mha)
    assert store.options.plugin == "posix" and store.options.use_direct_io is False
    store.close()
