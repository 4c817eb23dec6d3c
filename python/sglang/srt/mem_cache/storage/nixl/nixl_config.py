"""Options of the NIXL backend, from the extra config and the environment, validated up front.

Two forms of plugin selection are accepted:

* flat: ``{"plugin": "obj", "plugin_params": {"bucket": "b", "endpoint_override": "..."}}``
* upstream-style: ``{"plugin": {"obj": {"bucket": "b", "active": true}, "posix": {...}}}`` where
  exactly the first entry marked ``"active": true`` is used (none active is an error).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from sglang.srt.mem_cache.storage.extra_config import ExtraKey, parse_keys


class StorageKind(str, Enum):
    FILE = "FILE"
    OBJ = "OBJ"


class DirectIO(str, Enum):
    AUTO = "auto"  # O_DIRECT for pools whose pages are 4096-aligned, when the filesystem allows it
    TRUE = "true"  # the same, and an error at startup when the filesystem does not allow it
    FALSE = "false"


@dataclass(frozen=True)
class PluginSpec:
    nixl_name: str
    kind: StorageKind
    required_params: tuple[str, ...] = ()


PLUGINS = {
    "posix": PluginSpec("POSIX", StorageKind.FILE),
    "obj": PluginSpec("OBJ", StorageKind.OBJ, ("bucket",)),
}

EXTRA_KEYS = (
    ExtraKey("plugin", str, "posix", env="SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", choices=tuple(PLUGINS)),
    ExtraKey("plugin_params", dict, {}),
    ExtraKey("storage_dir", str, "/tmp/hicache_storage", env="SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"),
    ExtraKey("use_direct_io", str, "auto", env="SGLANG_HICACHE_NIXL_USE_DIRECT_IO",
             choices=tuple(m.value for m in DirectIO)),
    ExtraKey("bounce_pages", int, 128, minimum=1),
    ExtraKey("transfer_timeout_s", float, 60.0, minimum=0.001),
)


@dataclass(frozen=True)
class NixlOptions:
    plugin: str
    plugin_params: dict  # str -> str, as NIXL takes them
    storage_dir: str
    use_direct_io: DirectIO
    bounce_pages: int
    transfer_timeout_s: float

    @property
    def spec(self) -> PluginSpec:
        return PLUGINS[self.plugin]


def _unnest_plugin(extra: dict) -> dict:
    """Turn the upstream nested ``plugin`` dict into the flat form."""
    nested = extra.get("plugin")
    if not isinstance(nested, dict):
        return extra
    if "plugin_params" in extra:
        raise ValueError("nixl backend: give either a nested 'plugin' object or 'plugin_params', not both")
    active = [name for name, params in nested.items() if isinstance(params, dict) and params.get("active") is True]
    if not active:
        raise ValueError(
            f"nixl backend: extra config key 'plugin' has no entry marked \"active\": true; "
            f"entries: {', '.join(map(str, nested)) or 'none'}; allowed plugins: {', '.join(PLUGINS)}"
        )
    params = {k: v for k, v in nested[active[0]].items() if k != "active"}
    return {**extra, "plugin": active[0], "plugin_params": params}


def _param_str(name: str, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"nixl backend: extra config key 'plugin_params.{name}' must be a string, number or boolean, "
                     f"got {value!r}")


def parse_nixl_options(extra_config: dict) -> NixlOptions:
    extra = _unnest_plugin(extra_config)
    if isinstance(extra.get("use_direct_io"), bool):
        extra = {**extra, "use_direct_io": "true" if extra["use_direct_io"] else "false"}
    values = parse_keys(extra, EXTRA_KEYS, "nixl backend")
    spec = PLUGINS[values["plugin"]]
    params = {str(k): _param_str(k, v) for k, v in values["plugin_params"].items()}
    if spec.kind is StorageKind.OBJ and "bucket" not in params and os.environ.get("AWS_DEFAULT_BUCKET"):
        params["bucket"] = os.environ["AWS_DEFAULT_BUCKET"]
    missing = [p for p in spec.required_params if not params.get(p)]
    if missing:
        raise ValueError(f"nixl backend: plugin {values['plugin']!r} needs extra config key "
                         f"'plugin_params.{missing[0]}' (or AWS_DEFAULT_BUCKET for the bucket)")
    return NixlOptions(
        plugin=values["plugin"],
        plugin_params=params,
        storage_dir=os.path.abspath(values["storage_dir"]),
        use_direct_io=DirectIO(values["use_direct_io"]),
        bounce_pages=values["bounce_pages"],
        transfer_timeout_s=values["transfer_timeout_s"],
    )
