"""Options of the NIXL backend, from the extra config and the environment, validated up front.

Two forms of plugin selection are accepted:

* flat: ``{"plugin": "obj", "plugin_params": {"bucket": "b", "endpoint_override": "..."}}``
* upstream-style: ``{"plugin": {"obj": {"bucket": "b", "active": true}, "posix": {...}}}`` where
  exactly the first entry marked ``"active": true`` is used (none active is an error).

Files (POSIX) go under ``storage_dir`` or, one directory per disk, ``storage_dirs`` (a list, or
a comma-separated ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``), else under the backend's
``file_path`` argument (comma-separated too; upstream's constructor keyword), else under
<tempdir>/hicache_storage-<uid> (created 0700, refusing a symlink or another user's directory).
``use_direct_io`` (default true, upstream's key) asks for O_DIRECT where a pool's pages are 4096-aligned; a filesystem that refuses it falls back to buffered I/O with a
warning. Their total size is kept within
``capacity_gb`` (0: half the free space at startup) by evicting whole page groups once it passes
``high_watermark`` percent of that budget, down to ``low_watermark`` percent (``capacity.py``).
Upstream's spellings ``l3_cleaner_high_watermark`` / ``l3_cleaner_low_watermark`` /
``l3_cleaner_enabled`` are accepted for the same settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from sglang.srt.mem_cache.storage.extra_config import ExtraKey, parse_keys
from sglang.srt.utils.private_dir import user_private_dir

STORAGE_DIR_ENV = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"


class StorageKind(str, Enum):
    FILE = "FILE"
    OBJ = "OBJ"


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
    ExtraKey("storage_dir", str, "", env=STORAGE_DIR_ENV),
    ExtraKey("storage_dirs", list, []),
    ExtraKey("use_direct_io", bool, True, env="SGLANG_HICACHE_NIXL_USE_DIRECT_IO",
             help="O_DIRECT where a pool's pages are 4096-aligned and the filesystem allows it"),
    ExtraKey("bounce_pages", int, 128, minimum=1),
    ExtraKey("transfer_timeout_s", float, 60.0, minimum=0.001),
    ExtraKey("capacity_gb", float, 0.0, minimum=0.0, help="0: half the free space of the first directory"),
    ExtraKey("high_watermark", float, 80.0, minimum=0.0, help="percent of the budget that starts eviction"),
    ExtraKey("low_watermark", float, 70.0, minimum=0.0, help="percent of the budget eviction stops at"),
    ExtraKey("eviction", bool, True, help="false: an external cleaner keeps the directories in bounds"),
)
DEFAULT_STORAGE_DIR_NAME = "hicache_storage"  # the default: <tempdir>/hicache_storage-<uid>, private
ALIASES = {"l3_cleaner_high_watermark": "high_watermark", "l3_cleaner_low_watermark": "low_watermark",
           "l3_cleaner_enabled": "eviction"}
FILE_ONLY_KEYS = ("storage_dir", "storage_dirs", "capacity_gb")


@dataclass(frozen=True)
class NixlOptions:
    plugin: str
    plugin_params: dict  # str -> str, as NIXL takes them
    storage_dirs: tuple[str, ...]  # absolute; a page group's directory is chosen by its key's hash
    use_direct_io: bool  # asked for; the file manager drops it where the filesystem refuses
    bounce_pages: int
    transfer_timeout_s: float
    capacity_bytes: int = 0  # 0: decided at startup from the free space
    high_watermark: float = 80.0  # percent of the budget
    low_watermark: float = 70.0
    eviction: bool = True

    @property
    def spec(self) -> PluginSpec:
        return PLUGINS[self.plugin]

    @property
    def storage_dir(self) -> str:
        """The first (for a single-directory store: the) storage directory."""
        return self.storage_dirs[0]


def _storage_dirs(values: dict, given: dict, file_path: str | None) -> tuple[str, ...]:
    """The directories from ``storage_dir`` / ``storage_dirs`` / the environment / ``file_path``,
    validated."""
    if "storage_dir" in given and "storage_dirs" in given:
        raise ValueError("nixl backend: give extra config key 'storage_dir' (one directory) or 'storage_dirs' "
                         "(a list), not both")
    if "storage_dirs" in given:
        dirs = values["storage_dirs"]
        if not dirs:
            raise ValueError("nixl backend: extra config key 'storage_dirs' is an empty list; give at least one "
                             "directory (or 'storage_dir')")
    else:
        dirs = [d.strip() for d in (values["storage_dir"] or file_path or user_private_dir(DEFAULT_STORAGE_DIR_NAME)).split(",")]
    if any(not d for d in dirs):
        raise ValueError(f"nixl backend: extra config key 'storage_dirs' has an empty entry: {dirs!r}")
    absolute = [os.path.abspath(d) for d in dirs]
    dupes = sorted({d for d in absolute if absolute.count(d) > 1})
    if dupes:
        raise ValueError(f"nixl backend: extra config key 'storage_dirs' names {dupes[0]} more than once; "
                         f"each directory may appear once")
    return tuple(absolute)


def _unalias(extra: dict) -> dict:
    out = dict(extra)
    for old, new in ALIASES.items():
        if old in out:
            if new in out:
                raise ValueError(f"nixl backend: extra config keys {old!r} and {new!r} are the same setting; give one")
            out[new] = out.pop(old)
    return out


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


def parse_nixl_options(extra_config: dict, file_path: str | None = None) -> NixlOptions:
    """The validated options; ``file_path``: the default storage directories (comma-separated)."""
    extra = _unalias(_unnest_plugin(extra_config))
    if extra.get("use_direct_io") == "auto":  # this fork's earlier spelling of the default
        extra = {**extra, "use_direct_io": True}
    values = parse_keys(extra, EXTRA_KEYS, "nixl backend")
    spec = PLUGINS[values["plugin"]]
    params = {str(k): _param_str(k, v) for k, v in values["plugin_params"].items()}
    if spec.kind is StorageKind.OBJ and "bucket" not in params and os.environ.get("AWS_DEFAULT_BUCKET"):
        params["bucket"] = os.environ["AWS_DEFAULT_BUCKET"]
    missing = [p for p in spec.required_params if not params.get(p)]
    if missing:
        raise ValueError(f"nixl backend: plugin {values['plugin']!r} needs extra config key "
                         f"'plugin_params.{missing[0]}' (or AWS_DEFAULT_BUCKET for the bucket)")
    if spec.kind is not StorageKind.FILE:
        given = [k for k in FILE_ONLY_KEYS if k in extra]
        if given:
            raise ValueError(f"nixl backend: extra config key {given[0]!r} applies to file plugins only; "
                             f"plugin {values['plugin']!r} stores objects")
    high, low = values["high_watermark"], values["low_watermark"]
    if not 0 < low < high <= 100:
        raise ValueError(f"nixl backend: extra config keys 'low_watermark' ({low}) and 'high_watermark' ({high}) "
                         f"must satisfy 0 < low_watermark < high_watermark <= 100 (percent of capacity_gb)")
    return NixlOptions(
        plugin=values["plugin"],
        plugin_params=params,
        storage_dirs=_storage_dirs(values, extra, file_path),
        use_direct_io=values["use_direct_io"],
        bounce_pages=values["bounce_pages"],
        transfer_timeout_s=values["transfer_timeout_s"],
        capacity_bytes=int(values["capacity_gb"] * (1 << 30)),
        high_watermark=high,
        low_watermark=low,
        eviction=values["eviction"],
    )
