"""An out-of-tree L3 backend (loaded through ``dynamic``) whose constructor fails on one TP rank
only (extra config ``fail_rank``); elsewhere it is the real file backend."""

import dataclasses

from sglang.srt.mem_cache.hicache_storage import HiCacheFile


class ConstructorFailed(RuntimeError):
    pass


class FailOnRankBackend(HiCacheFile):
    def __init__(self, storage_config, file_path=None):
        extra = dict(storage_config.extra_config)
        fail_rank = extra.pop("fail_rank")
        if storage_config.tp_rank == fail_rank:
            raise ConstructorFailed(f"constructor fails on TP rank {fail_rank} on purpose")
        super().__init__(dataclasses.replace(storage_config, extra_config=extra), file_path)
