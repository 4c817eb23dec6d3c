"""Bad indices or a mismatched device pool raise ValueError and change neither pool."""

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, PoolKind
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.kv_pools import as_bytes, make_device_pool, make_host_pool, randomize_bytes

register_cpu_ci(est_time=5, suite="per-commit-cpu")

P = 4


@pytest.fixture(params=[("layer_first", "direct"), ("page_first_direct", "direct"), ("page_first", "kernel")])
def pools(request):
    dev = make_device_pool(PoolKind.MHA, torch.bfloat16, P, num_pages=8)
    host = make_host_pool(dev, *request.param)
    gen = torch.Generator().manual_seed(0)
    for buf in dev.buffers.values():
        randomize_bytes(buf, gen)
    for comp in host.components:
        randomize_bytes(host.host_buffer(comp.name), gen)
    return dev, host


def snapshot(dev, host):
    return [as_bytes(b).clone() for b in dev.buffers.values()] + [
        as_bytes(host.host_buffer(c.name)).clone() for c in host.components
    ]


BAD = [
    # (host indices, device indices, message fragment)
    (torch.arange(0, 6), torch.arange(4, 10), "not a multiple of page_size 4"),
    (torch.arange(2, 6), torch.arange(4, 8), "page starts at slot 2"),
    (torch.tensor([0, 1, 3, 2]), torch.arange(4, 8), "not 4 consecutive slots"),
    (torch.arange(0, 8), torch.arange(4, 8), "differ in length"),
    (torch.arange(64, 68), torch.arange(4, 8), "host indices out of range"),
    (torch.arange(0, 4), torch.arange(36, 40), "device indices out of range"),
    (torch.arange(0, 4).float(), torch.arange(4, 8), "int32/int64"),
    (torch.arange(0, 4).view(2, 2), torch.arange(4, 8), "must be 1-D"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[2] for c in BAD])
def test_bad_indices_change_nothing(pools, case):
    dev, host = pools
    host_idx, dev_idx, fragment = case
    before = snapshot(dev, host)
    with pytest.raises((ValueError, TypeError), match=fragment):
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    with pytest.raises((ValueError, TypeError), match=fragment):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    after = snapshot(dev, host)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_bad_layer_changes_nothing(pools):
    dev, host = pools
    before = snapshot(dev, host)
    with pytest.raises(ValueError, match="layer_id 2 outside \\[0, 2\\)"):
        host.load_to_device_per_layer(dev, torch.arange(0, 4), torch.arange(4, 8), 2)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dev, host)))


@pytest.mark.parametrize(
    "other",
    [
        lambda: MHATokenToKVPool(32, P, torch.float16, 2, 8, 2),  # dtype
        lambda: MHATokenToKVPool(32, P, torch.bfloat16, 4, 8, 2),  # heads
        lambda: MHATokenToKVPool(32, P, torch.bfloat16, 2, 8, 3),  # layers
        lambda: MHATokenToKVPool(32, 2, torch.bfloat16, 2, 8, 2),  # page size
        lambda: make_device_pool(PoolKind.MLA, torch.bfloat16, P),  # kind
    ],
    ids=["dtype", "heads", "layers", "page_size", "kind"],
)
def test_mismatched_device_pool_changes_nothing(pools, other):
    dev, host = pools
    wrong = other()
    before = snapshot(dev, host) + [as_bytes(b).clone() for b in wrong.buffers.values()]
    with pytest.raises(ValueError, match="device pool does not match|page_size"):
        host.load_to_device_per_layer(wrong, torch.arange(0, 4), torch.arange(4, 8), 0)
    with pytest.raises(ValueError, match="device pool does not match|page_size"):
        host.backup_from_device_all_layer(wrong, torch.arange(0, 4), torch.arange(4, 8))
    after = snapshot(dev, host) + [as_bytes(b).clone() for b in wrong.buffers.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_other_device_pool_of_same_geometry_works(pools):
    dev, host = pools
    twin = MHATokenToKVPool(32, P, torch.bfloat16, 2, 8, 2)
    host.backup_from_device_all_layer(dev, torch.arange(0, 4), torch.arange(4, 8))
    for layer in range(2):
        host.load_to_device_per_layer(twin, torch.arange(0, 4), torch.arange(8, 12), layer)
    for name in ("k", "v"):
        assert torch.equal(as_bytes(twin.buffers[name][:, 8:12]), as_bytes(dev.buffers[name][:, 4:8]))


def test_indices_checked_once_per_load_and_again_after_an_in_place_change(pools, monkeypatch):
    """A load checks the same index tensors once for all its layers; a tensor changed in place
    since (torch bumps its version) is checked again and refused."""
    from sglang.srt.mem_cache.pool_host import base

    dev, host = pools
    calls = []
    real = base.check_page_aligned
    monkeypatch.setattr(base, "check_page_aligned", lambda *a, **k: calls.append(1) or real(*a, **k))
    host_idx, dev_idx = torch.arange(0, 8), torch.arange(8, 16)
    for layer in range(host.layer_num):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
    assert len(calls) == 2  # host and device indices, once
    host_idx[0] = 1  # now not page aligned
    before = snapshot(dev, host)
    with pytest.raises(ValueError, match="not 4 consecutive slots|page starts at slot"):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dev, host)))
