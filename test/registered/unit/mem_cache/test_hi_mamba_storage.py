"""HiMambaRadixCache through L3: KV pages and the Mamba state after them (bf16 conv, fp32
temporal) are backed up, flushed from L1 and L2, prefetched and loaded back bit-exact, through
the file backend and NIXL POSIX. A prefix is only ever used with the state that ends it: a
missing state trims the hit to the last page with a state, or refuses it; a state that fails to
read refuses it. Pages prefetched under device nodes without host copies become their host
copies, so host copies stay a contiguous prefix from the root. Nothing leaks."""

import pytest
import torch
from tree_fixtures import MAMBA_A as A
from tree_fixtures import MAMBA_AB as AB
from tree_fixtures import MambaL3Env as Env
from tree_fixtures import mamba_l3_filled as filled
from tree_fixtures import snapshot

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")


@pytest.mark.parametrize("backend,layout", [("file", "layer_first"), ("nixl", "page_first_direct")])
def test_kv_and_state_round_trip_through_l3(tmp_path, backend, layout):
    env, kv_ab, _, state_b, _ = filled(tmp_path, backend=backend, layout=layout)
    stats = env.l3()
    backed_up = (stats["backup_pages_submitted"], stats["backup_states_submitted"], stats["backup_states_failed"])
    assert backed_up == (4, 2, 0)
    assert env.tree.match_prefix(MatchPrefixParams(key=RadixKey(AB))).host_hit_length == 0
    assert env.prefetch(AB) == len(AB)
    m, slots, end = env.load_back(AB)
    assert m.host_hit_length == len(AB) and end.mamba_value is not None
    got = snapshot(env.kv, slots)
    assert all(torch.equal(got[c], kv_ab[c]) for c in kv_ab), "KV bytes differ"
    got_state = snapshot(env.mamba, end.mamba_value)
    assert env.mamba.buffers["conv_0"].dtype == torch.bfloat16 and env.mamba.buffers["temporal"].dtype == torch.float32
    assert all(torch.equal(got_state[c], state_b[c]) for c in state_b), "state bytes differ"
    stats = env.l3()
    assert (stats["prefetch_pages_loaded"], stats["prefetch_state_misses"], stats["failures"]) == (4, 0, 0)
    env.tree.check_integrity()
    env.close()


def test_a_missing_state_trims_the_hit_to_the_last_page_with_a_state(tmp_path):
    env, kv_ab, state_a, _, hashes = filled(tmp_path)
    env.state_file(hashes[3]).unlink()  # the state after AB is gone; the one after A is not
    env.prefetch(AB)
    assert env.l3()["prefetch_pages_found"] == 2  # KV has 4 pages, a state only after page 2
    m, slots, end = env.load_back(AB)
    assert m.host_hit_length == len(A) and end.key.token_ids == list(A)
    got = snapshot(env.kv, slots)
    assert all(torch.equal(got[c], kv_ab[c][:, : len(A)]) for c in kv_ab)
    got_state = snapshot(env.mamba, end.mamba_value)
    assert all(torch.equal(got_state[c], state_a[c]) for c in state_a)
    env.tree.check_integrity()
    env.flush()
    env.state_file(hashes[1]).unlink()  # no state at all: the KV-only hit is refused
    env.prefetch(AB, rid="r2")
    assert env.tree.match_prefix(MatchPrefixParams(key=RadixKey(AB))).host_hit_length == 0
    assert list(env.tree.root_node.children) == []
    assert env.mamba_host.available_size() == env.mamba_host.size
    env.close()


def test_a_state_that_fails_to_read_refuses_the_hit(tmp_path):
    env, _, _, _, hashes = filled(tmp_path)
    path = env.state_file(hashes[3])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the checksum no longer matches: exists says yes, get says no
    path.write_bytes(bytes(raw))
    env.prefetch(AB)
    stats = env.l3()
    assert (stats["prefetch_pages_found"], stats["prefetch_state_misses"], stats["prefetch_pages_loaded"]) == (4, 1, 0)
    # KV arrived, but not without its state
    assert env.tree.match_prefix(MatchPrefixParams(key=RadixKey(AB))).host_hit_length == 0
    env.tree.check_integrity()
    assert env.controller.mem_pool_host.available_size() == env.controller.mem_pool_host.size
    assert env.mamba_host.available_size() == env.mamba_host.size
    env.close()


def test_prefetch_under_device_nodes_without_host_copies(tmp_path):
    """write_back: A is on device only. The prefetch climbs to the root, fetches A and B, A
    adopts the fetched pages as its host copy and B arrives host-only with its state."""
    filler, kv_ab, _, state_b, _ = filled(tmp_path)
    filler.close()
    env = Env(tmp_path, write_policy="write_back", seed=3)  # same bytes for A as the filler's
    env.insert(A)
    a = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_device_node
    assert not a.backuped
    m = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(AB)))
    assert m.last_host_node is a
    assert env.prefetch(AB[len(A):], node=a) == len(AB)  # the climb asks for A too
    assert a.backuped and a.mamba_host_value is None and not a.evicted
    env.tree.check_integrity()
    m, slots, end = env.load_back(AB)
    assert m.device_indices.numel() == len(A) and m.host_hit_length == len(AB) - len(A)
    got = snapshot(env.kv, slots)
    assert all(torch.equal(got[c], kv_ab[c]) for c in kv_ab)
    got_state = snapshot(env.mamba, end.mamba_value)
    assert all(torch.equal(got_state[c], state_b[c]) for c in state_b)
    env.tree.check_integrity()
    env.close()


def test_a_state_is_stored_alone_when_its_pages_already_are(tmp_path):
    env = Env(tmp_path)
    env.insert(AB)  # one node, one state after page 4
    env.settle()
    env.flush()
    _, state_a = env.insert(A)  # its pages are in L3 already, its state is not
    env.settle()
    stats = env.l3()
    assert (stats["backup_pages_existing"], stats["backup_states_submitted"], stats["backup_states_existing"]) \
        == (2, 2, 0)
    env.insert(A)  # a duplicate changes nothing
    env.flush()
    env.prefetch(A)
    _, _, end = env.load_back(A)
    got_state = snapshot(env.mamba, end.mamba_value)
    assert all(torch.equal(got_state[c], state_a[c]) for c in state_a)
    env.close()


def test_insert_host_takes_or_frees_the_state(tmp_path):
    env = Env(tmp_path)
    kv_host = env.controller.mem_pool_host
    host = kv_host.alloc(4)
    first, second = env.mamba_host.alloc(1), env.mamba_host.alloc(1)
    assert env.tree.insert_host(RadixKey(A), host, mamba_host_value=first) == 0
    node = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(A))).last_host_node
    assert node.mamba_host_value.tolist() == first.tolist() and node.host_value.tolist() == host.tolist()
    again = kv_host.alloc(4)
    assert env.tree.insert_host(RadixKey(A), again, mamba_host_value=second) == 4  # already held
    assert bool(env.mamba_host.allocator.is_free(second).all())  # the tree freed the second state
    kv_host.free(again)
    more = kv_host.alloc(8)
    with pytest.raises(ValueError, match="one slot"):
        env.tree.insert_host(RadixKey(AB), more, mamba_host_value=torch.tensor([1, 2]))
    kv_host.free(more)  # refused whole: the caller kept its slots
    env.tree.check_integrity()
    env.close()


def test_the_tree_must_take_the_states_its_controller_carries(tmp_path):
    env = Env(tmp_path)
    with pytest.raises(ValueError, match="cannot take 'mamba' states from L3"):
        HiRadixCache(env.stack.params, env.controller)
    env.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
