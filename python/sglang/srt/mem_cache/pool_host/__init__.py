"""Host (L2) pools, one class per pool kind, and HostPoolGroup (the DeepSeek-V4 pools live in
``mem_cache/memory_pool_host.py``, as upstream keeps them).

Names resolve lazily so that ``kvcacheio`` can import ``pool_host.layout`` without a cycle.
"""

import importlib

_EXPORTS = {
    "HostKVCache": "base",
    "MHATokenToKVPoolHost": "mha",
    "AsymmetricMHATokenToKVPoolHost": "mha",
    "get_mha_host_pool_cls": "mha",
    "MLATokenToKVPoolHost": "mla",
    "MambaPoolHost": "mamba",
    "DSAIndexerPoolHost": "dsa",
    "HostPoolGroup": "group",
    "PoolEntry": "group",
    "PoolName": "group",
    "HostLayout": "layout",
    "IOBackend": "layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
