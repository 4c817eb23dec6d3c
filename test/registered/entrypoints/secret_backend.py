"""An out-of-tree L3 backend (loaded through ``dynamic``) whose extra config holds credentials,
as an object store's does (``access_key``, ``secret_key``, an ``endpoint`` URL with a password);
elsewhere it is the real file backend. ``fail: true`` makes its constructor fail with an error
that quotes the whole extra config, credentials included (as careless SDKs do)."""

import dataclasses

from sglang.srt.mem_cache.hicache_storage import HiCacheFile

CREDENTIAL_KEYS = ("access_key", "secret_key", "endpoint", "fail")


class SecretFileBackend(HiCacheFile):
    def __init__(self, storage_config, file_path=None):
        extra = dict(storage_config.extra_config)
        if extra.get("fail"):
            raise ConnectionError(f"cannot reach the object store with {extra}")
        for key in CREDENTIAL_KEYS:
            extra.pop(key, None)
        super().__init__(dataclasses.replace(storage_config, extra_config=extra), file_path)
