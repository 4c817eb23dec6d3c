"""The dispatch table: every supported cell constructs, every other cell raises at construction."""

import pytest

from sglang.srt.mem_cache.kvcacheio.dispatch import IO_TABLE, default_io_backend, resolve_io
from sglang.srt.mem_cache.memory_pool import PoolKind
from sglang.srt.mem_cache.pool_host.layout import HostLayout, IOBackend
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import make_device_pool, make_host_pool

register_cpu_ci(est_time=5, suite="per-commit-cpu")

ALL_CELLS = [(k, lay, io) for k in PoolKind for lay in HostLayout for io in IOBackend]


@pytest.mark.parametrize("cell", ALL_CELLS, ids=lambda c: f"{c[0].value}-{c[1].value}-{c[2].value}")
def test_every_cell(cell):
    kind, layout, io = cell
    dev = make_device_pool(kind, page_size=1 if kind is PoolKind.MAMBA else 4)
    if cell in IO_TABLE:
        host = make_host_pool(dev, layout, io)
        assert host.io is IO_TABLE[cell]
        assert (host.layout, host.io_backend) == (layout, io)
    else:
        with pytest.raises(ValueError) as err:
            make_host_pool(dev, layout, io)
        msg = str(err.value)
        assert f"layout={layout.value}" in msg and f"io_backend={io.value}" in msg
        # the message lists the supported cells of this kind
        for k, lay, backend in IO_TABLE:
            if k is kind:
                assert f"{lay.value}+{backend.value}" in msg


def test_table_shape():
    """page_first and page_head are kernel-only; page_head is MHA-only."""
    for kind, layout, io in IO_TABLE:
        if layout is HostLayout.PAGE_HEAD:
            assert (kind, io) == (PoolKind.MHA, IOBackend.KERNEL)
        if layout is HostLayout.PAGE_FIRST and kind is not PoolKind.DSV4_ANCHOR:
            assert io is IOBackend.KERNEL
    # every byte-holding kind supports direct page_first_direct (zero-copy friendly, no kernel)
    for kind in PoolKind:
        assert (kind, HostLayout.PAGE_FIRST_DIRECT, IOBackend.DIRECT) in IO_TABLE


def test_bad_names_are_refused():
    dev = make_device_pool(PoolKind.MHA)
    with pytest.raises(ValueError, match="unknown host layout 'page_last'.*allowed: layer_first"):
        make_host_pool(dev, "page_last", "direct")
    with pytest.raises(ValueError, match="unknown io_backend 'dma'.*allowed: kernel, direct"):
        make_host_pool(dev, "layer_first", "dma")


def test_wrong_device_pool_kind():
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    with pytest.raises(TypeError, match="MLATokenToKVPoolHost mirrors a mla pool, got MHATokenToKVPool"):
        MLATokenToKVPoolHost(make_device_pool(PoolKind.MHA))


def test_default_io_backend():
    assert default_io_backend("cpu") is IOBackend.DIRECT
    assert default_io_backend("cuda") is IOBackend.KERNEL
    assert make_host_pool(make_device_pool(PoolKind.MHA), "layer_first", None).io_backend is IOBackend.DIRECT


def test_resolve_io_direct():
    assert resolve_io(PoolKind.MLA, HostLayout.LAYER_FIRST, IOBackend.DIRECT).name == "direct"
