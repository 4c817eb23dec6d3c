"""Options of the Mooncake backend, read as upstream reads them.

The Mooncake settings come from one source, in upstream's order: the extra config when it names
a master (``master_server_address``), else the JSON file at ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``,
else the environment (``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
``MOONCAKE_TENANT_ID``). Within a config (extra config or file) a missing key falls back to
upstream's default, except ``protocol``, which falls back to ``MOONCAKE_PROTOCOL``.
``local_hostname`` is per process, as upstream: ``MOONCAKE_LOCAL_HOSTNAME``, then
``LOCAL_HOSTNAME``, then the config's value, then ``localhost``.

This fork's own keys (``transfer_timeout_s``, ``namespace_salt``) are read from the extra config
whatever the source of the Mooncake settings. Upstream keys for features this backend does not
have (a standalone "dummy" client, SSD offload, group semantics, server checks) are accepted
only at their neutral value; anything else is refused at startup with the allowed keys listed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from sglang.srt.mem_cache.storage.extra_config import COMMON_KEYS, ExtraKey, parse_keys

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20  # upstream's: the zero-copy paths do not use it

# upstream key -> (environment variable, upstream default)
MOONCAKE_KEYS = {
    "master_server_address": ("MOONCAKE_MASTER", None),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb"),
    "protocol": ("MOONCAKE_PROTOCOL", "rdma"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "tenant_id": ("MOONCAKE_TENANT_ID", "default"),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
}
# upstream keys of features this backend does not have -> the only value accepted
NEUTRAL_KEYS = {
    "client_server_address": None,
    "standalone_storage": False,
    "enable_ssd_offload": False,
    "ssd_offload_path": None,
    "enable_group_semantics": False,
    "check_server": False,
    "extra_backend_tag": None,
}
IGNORED_KEYS = ("master_metrics_port",)  # upstream's, used only by check_server
OWN_KEYS = (
    ExtraKey("transfer_timeout_s", float, 30.0, minimum=1.0,
             help="bound of a transfer whose peer stopped answering (sets Mooncake's TCP timeouts)"),
)
ALLOWED_EXTRA_KEYS = tuple(sorted({*MOONCAKE_KEYS, *NEUTRAL_KEYS, *IGNORED_KEYS, *(k.name for k in OWN_KEYS),
                                   *COMMON_KEYS}))


def parse_segment_size(value) -> int:
    """Bytes from an int or upstream's string form (``"4gb"``, ``"1073741824"``); ValueError else."""
    if isinstance(value, bool):
        raise ValueError(f"global_segment_size must be bytes or '<n>gb', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and value.strip().lower().endswith("gb") and value.strip()[:-2].strip().isdigit():
        size = int(value.strip()[:-2]) << 30
    elif isinstance(value, str) and value.strip().isdigit():
        size = int(value.strip())
    else:
        raise ValueError(f"global_segment_size must be bytes or '<n>gb', got {value!r}")
    if size < 0:
        raise ValueError(f"global_segment_size must be >= 0, got {value!r}")
    return size


@dataclass(frozen=True)
class MooncakeOptions:
    master_server_address: str
    metadata_server: str
    global_segment_size: int  # bytes contributed by the whole server (split over tp * pp ranks)
    protocol: str
    device_name: str  # a device list, or JSON {tp_rank: devices}
    tenant_id: str
    local_hostname: str
    transfer_timeout_s: float
    source: str  # where the Mooncake settings came from (logged)

    def __post_init__(self):
        for name in ("master_server_address", "metadata_server", "protocol", "tenant_id", "local_hostname"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"mooncake backend ({self.source}): {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.device_name, str):
            raise ValueError(f"mooncake backend ({self.source}): device_name must be a string, "
                             f"got {self.device_name!r}")

    def segment_bytes(self, tp_size: int, pp_size: int) -> int:
        """This rank's share of ``global_segment_size`` (upstream divides it over tp * pp ranks)."""
        return self.global_segment_size // (tp_size * pp_size)

    def device_for(self, tp_rank: int) -> str:
        """``device_name``, or this TP rank's entry when it is a JSON map (``""`` when absent)."""
        if not self.device_name.strip().startswith("{"):
            return self.device_name
        try:
            devices = json.loads(self.device_name)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mooncake backend: device_name is not valid JSON: {exc}") from None
        value = devices.get(str(tp_rank), devices.get(tp_rank, ""))
        if not isinstance(value, str):
            raise ValueError(f"mooncake backend: device_name[{tp_rank}] must be a string, got {value!r}")
        return value


def _mooncake_source(extra: dict) -> tuple[dict, str]:
    """(settings, source name): the extra config, the JSON file or the environment."""
    if extra.get("master_server_address") is not None:
        return {k: extra[k] for k in (*MOONCAKE_KEYS, *NEUTRAL_KEYS, *IGNORED_KEYS) if k in extra}, "extra config"
    for key in (*MOONCAKE_KEYS, *NEUTRAL_KEYS):
        if key in extra:
            raise ValueError(f"mooncake backend: extra config key {key!r} given without master_server_address; "
                             f"give master_server_address too, or configure through {CONFIG_PATH_ENV} or "
                             f"the MOONCAKE_* environment")
    path = os.environ.get(CONFIG_PATH_ENV)
    if path:
        try:
            with open(path) as f:
                settings = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"mooncake backend: cannot read {CONFIG_PATH_ENV}={path}: {exc}") from None
        if not isinstance(settings, dict) or "master_server_address" not in settings:
            raise ValueError(f"mooncake backend: {path} must be a JSON object with master_server_address")
        return settings, f"file {path}"
    if not os.environ.get("MOONCAKE_MASTER"):
        raise ValueError("mooncake backend: no master configured; give extra config key master_server_address, "
                         f"a JSON file in {CONFIG_PATH_ENV}, or MOONCAKE_MASTER")
    return {k: os.environ[env] for k, (env, _) in MOONCAKE_KEYS.items()
            if k != "local_hostname" and os.environ.get(env)}, "environment"


def _check_keys(settings: dict, source: str) -> None:
    for key, value in settings.items():
        if key in MOONCAKE_KEYS or key in IGNORED_KEYS:
            continue
        if key not in NEUTRAL_KEYS:
            raise ValueError(f"mooncake backend ({source}): unknown key {key!r}; "
                             f"allowed: {', '.join(ALLOWED_EXTRA_KEYS)}")
        if value not in (None, NEUTRAL_KEYS[key]):
            raise ValueError(f"mooncake backend ({source}): {key}={value!r} is not supported by this backend; "
                             f"allowed: {NEUTRAL_KEYS[key]!r}")


def _local_hostname(settings: dict) -> str:
    for env in ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"):
        if os.environ.get(env):
            return os.environ[env]
    return settings.get("local_hostname") or MOONCAKE_KEYS["local_hostname"][1]


def parse_mooncake_options(extra_config: dict) -> MooncakeOptions:
    """The backend's options from the extra config, the config file and the environment."""
    extra = dict(extra_config)
    for key in extra:
        if key not in ALLOWED_EXTRA_KEYS:
            raise ValueError(f"mooncake backend: unknown extra config key {key!r}; "
                             f"allowed: {', '.join(ALLOWED_EXTRA_KEYS)}")
    settings, source = _mooncake_source(extra)
    _check_keys(settings, source)
    own = parse_keys({k: v for k, v in extra.items() if k not in settings and k not in IGNORED_KEYS},
                     OWN_KEYS, "mooncake backend")
    values = {k: settings.get(k, default) for k, (_, default) in MOONCAKE_KEYS.items()}
    if "protocol" not in settings:
        values["protocol"] = os.environ.get("MOONCAKE_PROTOCOL") or values["protocol"]
    return MooncakeOptions(
        master_server_address=values["master_server_address"],
        metadata_server=values["metadata_server"],
        global_segment_size=parse_segment_size(values["global_segment_size"]),
        protocol=values["protocol"],
        device_name=values["device_name"],
        tenant_id=str(values["tenant_id"]).strip() or "default",
        local_hostname=_local_hostname(settings),
        transfer_timeout_s=own["transfer_timeout_s"],
        source=source,
    )

