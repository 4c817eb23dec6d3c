"""HiCacheConfig: the settings of a HiCache stack (the ``--hicache-*`` flags), L2 and L3.

Parallel coordinates are NOT here: they live in ``CacheInitParams`` only. The storage (L3)
fields take the server's flags as they are: ``storage_backend`` (a StorageBackendFactory name),
``storage_backend_extra_config`` (a dict or a JSON object string; the controller's own keys are
listed in ``storage_settings.py``, the rest goes to the backend), ``prefetch_policy``, the
prefetch retry flags (``prefetch_retry_poll_interval``, ``prefetch_retry_max_attempts``) and
``model_name``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.choice_enum import ChoiceEnum
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.srt.mem_cache.controller.storage_settings import (
    PrefetchRetrySettings,
    parse_extra_config_arg,
    split_extra_config,
)


class WritePolicy(ChoiceEnum):
    """When a device node gets a host copy.

    ``write_through``: on its first insert. ``write_through_selective``: on its second insert
    (a prefix seen twice). ``write_back``: only when it is evicted from the device.
    """

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @property
    def backup_threshold(self) -> int | None:
        """Inserts through a node after which it is backed up; None: only on eviction."""
        return _THRESHOLD[self]


class PrefetchPolicy(ChoiceEnum):
    """When a waiting request stops waiting for its L3 prefetch.

    ``best_effort``: at the first ``check_prefetch_progress``, with what has arrived.
    ``wait_complete``: once every page that storage holds has arrived (or failed).
    ``timeout``: like ``wait_complete``, but at most ``prefetch_timeout_base +
    prefetch_timeout_per_ki_token * hit_tokens / 1024`` seconds after the prefetch started.
    Every policy also stops at ``prefetch_timeout_max`` (a backend that hangs cannot hold a
    request forever).
    """

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"

    @classmethod
    def label(cls) -> str:
        return "prefetch_policy"


# upstream 0.5.23's default: an idle server waits (within the budget) for its L3 hits instead of
# scheduling the request before any page arrived
DEFAULT_PREFETCH_POLICY = PrefetchPolicy.TIMEOUT
# upstream's default host-to-device ratio (cache mode); a server given neither --hicache-ratio nor
# --hicache-size lowers it to fit --hicache-host-memory-fraction (mem_cache/hicache_auto_size.py)
DEFAULT_HICACHE_RATIO = 2.0

_THRESHOLD = {
    WritePolicy.WRITE_THROUGH: 1,
    WritePolicy.WRITE_THROUGH_SELECTIVE: 2,
    WritePolicy.WRITE_BACK: None,
}


@dataclass
class HiCacheConfig:
    """Host tier settings.

    ``hicache_ratio``: host slots per device slot (used when ``hicache_size_gb`` is 0); None (an
    unset ``--hicache-ratio``) is ``DEFAULT_HICACHE_RATIO``.
    ``hicache_size_gb``: host pool size in GB (split over the pools of a hybrid stack in
    proportion to their bytes per token). ``io_backend``: None picks ``kernel`` on CUDA and
    ``direct`` elsewhere. ``load_back_threshold``: host hits shorter than this many tokens are
    recomputed instead of loaded.

    ``storage_backend``: None (no L3) or a StorageBackendFactory name (``file``, ``nixl``,
    ``dynamic``); ``model_name`` is then required (it is part of every storage key).
    ``storage_backend_extra_config``: a dict or a JSON object string, validated here: the
    controller's keys (``storage_settings.py``) by value, the backend's keys when the backend
    is built. ``prefetch_policy``: see :class:`PrefetchPolicy`. ``prefetch_retry_poll_interval``
    / ``prefetch_retry_max_attempts``: when a missed L3 check is issued again (the tree's
    ``prefetch_retry``, see ``hiradix/prefetch_retries.py``).
    """

    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    hicache_ratio: float | None = DEFAULT_HICACHE_RATIO
    hicache_size_gb: float = 0.0
    mem_layout: HostLayout | str = HostLayout.LAYER_FIRST
    io_backend: IOBackend | str | None = None
    load_back_threshold: int = 0
    storage_backend: str | None = None
    storage_backend_extra_config: dict | str | None = None
    prefetch_policy: PrefetchPolicy | str = DEFAULT_PREFETCH_POLICY
    prefetch_retry_poll_interval: int = PrefetchRetrySettings.poll_interval
    prefetch_retry_max_attempts: int = PrefetchRetrySettings.max_attempts
    model_name: str | None = None

    def __post_init__(self):
        self.write_policy = WritePolicy.parse(self.write_policy)
        self.mem_layout = HostLayout.parse(self.mem_layout)
        if self.io_backend is not None:
            self.io_backend = IOBackend.parse(self.io_backend)
        if self.hicache_ratio is None:
            self.hicache_ratio = DEFAULT_HICACHE_RATIO
        if self.hicache_size_gb < 0:
            raise ValueError(f"hicache_size_gb must be >= 0, got {self.hicache_size_gb}")
        if self.hicache_size_gb == 0 and self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0 when hicache_size_gb is 0, got {self.hicache_ratio}")
        if self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0, got {self.load_back_threshold}")
        self.prefetch_policy = PrefetchPolicy.parse(self.prefetch_policy)
        self.prefetch_retry  # a bad value fails here, naming the setting
        self._check_storage()

    def _check_storage(self) -> None:
        extra = parse_extra_config_arg(self.storage_backend_extra_config, "storage_backend_extra_config")
        if self.storage_backend is None:
            if extra:
                raise ValueError("storage_backend_extra_config is set but storage_backend is None; set both or neither")
            return
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        known = StorageBackendFactory.known_backends()
        if self.storage_backend not in known:
            raise ValueError(f"storage_backend {self.storage_backend!r} is not allowed; allowed: {', '.join(known)}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(
                f"model_name must be a non-empty string when storage_backend is set, got {self.model_name!r}"
            )
        split_extra_config(extra)  # the controller's keys: a bad value fails here, naming the key
        self.storage_backend_extra_config = extra

    @property
    def prefetch_retry(self) -> PrefetchRetrySettings:
        return PrefetchRetrySettings(self.prefetch_retry_poll_interval, self.prefetch_retry_max_attempts)

    @property
    def storage_kwargs(self) -> dict:
        """Keyword arguments that attach this config's L3 backend to a HiCacheController."""
        if self.storage_backend is None:
            return {}
        return {
            "storage_backend": self.storage_backend,
            "storage_backend_extra_config": dict(self.storage_backend_extra_config),
            "model_name": self.model_name,
        }
