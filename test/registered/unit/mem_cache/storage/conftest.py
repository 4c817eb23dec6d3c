"""Fixtures for the storage tests: small host pools, page keys, backends, a local S3 server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import (
    DeepSeekV4StatePool,
    DSAIndexerPool,
    LogicalAnchorPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PoolKind,
)
from sglang.srt.mem_cache.radix.page_hash import namespace_hash, page_hashes
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.test.kv_pools import make_host_pool

BACKENDS = ["file", "nixl_posix", "nixl_obj"]
S3_KEYS = {"access_key": "testing", "secret_key": "testing", "region": "us-east-1"}


def device_pool(kind: PoolKind, dtype=torch.bfloat16, page_size=4, num_pages=8, layer_num=2, **kw):
    size = num_pages * page_size
    if kind is PoolKind.MHA:
        return MHATokenToKVPool(size, page_size, dtype, kw.get("head_num", 2), kw.get("head_dim", 8), layer_num)
    if kind is PoolKind.MLA:
        return MLATokenToKVPool(size, page_size, dtype, 8, 4, layer_num)
    if kind is PoolKind.MAMBA:
        return MambaPool(num_pages, [(3, 4), (2, 6)], (2, 4, 2), layer_num, conv_dtype=dtype)
    if kind is PoolKind.DSA_INDEXER:
        return DSAIndexerPool(size, page_size, 8, layer_num, dtype)
    if kind is PoolKind.DSV4_ANCHOR:
        return LogicalAnchorPool(size, page_size, layer_num)
    if kind is PoolKind.DSV4_STATE:
        return DeepSeekV4StatePool(size, page_size, 12, layer_num, dtype)
    raise ValueError(kind)


def host_pool(kind: PoolKind, layout="page_first_direct", dtype=torch.bfloat16, page_size=4, num_pages=8, size=None, **kw):
    """A host pool of 2 x ``num_pages`` pages (``size`` slots when given)."""
    dev = device_pool(kind, dtype, page_size, num_pages, **kw)
    io = "kernel" if layout in ("page_first", "page_head") else "direct"  # the IO table's cells
    return make_host_pool(dev, layout, io, 2.0, size=size)


def fill_random(host, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in host.get_host_buffers():
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def page_keys(n: int, salt: str = "") -> list[str]:
    """``n`` page hashes of one token sequence (page size 1), in the namespace ``salt``."""
    return page_hashes(list(range(1000, 1000 + n)), 1, namespace_hash(salt))


def slots(host, first_page: int, num_pages: int) -> torch.Tensor:
    P = host.page_size
    return torch.arange(first_page * P, (first_page + num_pages) * P)


def pages_of(host, first_page: int, num_pages: int) -> list[torch.Tensor]:
    return [host.get_data_page((first_page + i) * host.page_size) for i in range(num_pages)]


def storage_config(host, extra=None, model="test-model", **ranks) -> HiCacheStorageConfig:
    params = CacheInitParams(page_size=getattr(host, "page_size", 1), **ranks)
    return HiCacheStorageConfig.from_cache_params(params, host, model, extra)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 at a free port, stopped after the session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.1)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


def s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=S3_KEYS["region"],
        aws_access_key_id=S3_KEYS["access_key"],
        aws_secret_access_key=S3_KEYS["secret_key"],
    )


def obj_extra(endpoint: str, bucket: str | None = None) -> dict:
    """Extra config of the NIXL OBJ plugin against ``endpoint``, with a fresh bucket."""
    bucket = bucket or f"hicache-{uuid.uuid4().hex[:12]}"
    s3_client(endpoint).create_bucket(Bucket=bucket)
    params = {"bucket": bucket, "endpoint_override": endpoint, "scheme": "http", "use_virtual_addressing": False}
    return {"plugin": "obj", "plugin_params": {**params, **S3_KEYS}}


@pytest.fixture
def make_backend(tmp_path, request):
    """make_backend(name, host, extra=None, **ranks): a backend of ``name`` (BACKENDS), closed
    after the test. Backends made with the same ``share`` tag share their storage."""
    made, shared = [], {}

    def make(name, host, extra=None, share=None, **ranks):
        if share is not None and share in shared:
            base = dict(shared[share])
        elif name == "file":
            base = {"storage_dir": str(tmp_path / f"file-{len(made)}")}
        elif name == "nixl_posix":
            base = {"storage_dir": str(tmp_path / f"nixl-{len(made)}")}
        else:
            base = obj_extra(request.getfixturevalue("s3_endpoint"))
        if share is not None:
            shared.setdefault(share, base)
        backend = StorageBackendFactory.create_backend(
            "file" if name == "file" else "nixl", storage_config(host, {**base, **(extra or {})}, **ranks), host
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
