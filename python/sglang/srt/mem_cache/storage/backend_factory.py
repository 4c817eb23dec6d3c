"""StorageBackendFactory: backend name -> "module:Class", imported only when built.

Every backend is constructed the same way, ``cls(storage_config)``, and then given the host
pool (``register_mem_pool_host``). The ``dynamic`` entry takes the class from the extra config
(``module_path``, ``class_name``) so an out-of-tree backend needs no change here. The factory
never looks at a name beyond the table.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

logger = logging.getLogger(__name__)


def _fixed(spec: str) -> Callable[[HiCacheStorageConfig], str]:
    return lambda config: spec


def _from_extra_config(config: HiCacheStorageConfig) -> str:
    extra = config.extra_config
    missing = [k for k in ("module_path", "class_name") if not isinstance(extra.get(k), str) or not extra.get(k)]
    if missing:
        raise ValueError(f"backend 'dynamic' needs extra config keys module_path and class_name (strings); "
                         f"missing or not a string: {', '.join(missing)}")
    return f"{extra['module_path']}:{extra['class_name']}"


class StorageBackendFactory:
    _registry: dict[str, Callable[[HiCacheStorageConfig], str]] = {
        "file": _fixed("sglang.srt.mem_cache.hicache_storage:HiCacheFile"),
        "nixl": _fixed("sglang.srt.mem_cache.storage.nixl.hicache_nixl:HiCacheNixl"),
        "mooncake": _fixed("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store:MooncakeStore"),
        "dynamic": _from_extra_config,
    }
    # backends that store one key over several host pages (HiCacheStorageConfig.storage_page_size)
    _page_span_backends: set[str] = {"file", "nixl"}

    @classmethod
    def register_backend(cls, name: str, spec: str, page_spans: bool = False) -> None:
        """Add ``name`` -> ``"package.module:Class"`` (ValueError if the name is taken).
        ``page_spans``: the backend honours ``storage_page_size``."""
        if name in cls._registry:
            raise ValueError(f"storage backend {name!r} is already registered")
        if spec.count(":") != 1:
            raise ValueError(f"backend spec must be 'module:Class', got {spec!r}")
        cls._registry[name] = _fixed(spec)
        if page_spans:
            cls._page_span_backends.add(name)

    @classmethod
    def backend_supports_page_spans(cls, name: str) -> bool:
        """Whether backend ``name`` stores one key over several host pages (span mode);
        False for an unknown name."""
        return name in cls._page_span_backends

    @classmethod
    def known_backends(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def load_class(cls, name: str, config: HiCacheStorageConfig) -> type[HiCacheStorage]:
        """The class behind ``name``; ValueError naming the known backends when it cannot be had."""
        known = ", ".join(cls.known_backends())
        if name not in cls._registry:
            raise ValueError(f"unknown storage backend {name!r}; known: {known}")
        spec = cls._registry[name](config)
        module_path, _, class_name = spec.partition(":")
        try:
            backend_cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"storage backend {name!r}: cannot load {spec} ({exc}); known: {known}") from exc
        if not (isinstance(backend_cls, type) and issubclass(backend_cls, HiCacheStorage)):
            raise ValueError(f"storage backend {name!r}: {spec} is not a HiCacheStorage subclass; known: {known}")
        return backend_cls

    @classmethod
    def create_backend(cls, name: str, storage_config: HiCacheStorageConfig, mem_pool_host=None) -> HiCacheStorage:
        """``cls(storage_config)`` of backend ``name``, with ``mem_pool_host`` registered (a host
        pool or a HostPoolGroup) when given. A backend that fails to register is closed."""
        if storage_config.storage_page_size is not None and not cls.backend_supports_page_spans(name):
            raise ValueError(f"storage backend {name!r} does not support storage_page_size; backends that do: "
                             f"{', '.join(sorted(cls._page_span_backends))}")
        backend_cls = cls.load_class(name, storage_config)
        logger.info("L3 storage backend: %s (%s)", name, backend_cls.__name__)
        backend = backend_cls(storage_config)
        if mem_pool_host is not None:
            try:
                backend.register_mem_pool_host(mem_pool_host)
            except BaseException:
                backend.close()
                raise
        return backend
