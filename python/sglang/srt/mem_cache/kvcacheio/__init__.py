"""KV cache IO between device and host pools: the dispatch table and its copy routines."""
