"""The NIXL L3 backend (HiCacheNixl). Importing this package applies the process's UCX settings
(``sglang.srt.utils.ucx_env``) before any module of it loads NIXL."""

from sglang.srt.utils.ucx_env import ensure_ucx_env

ensure_ucx_env()
