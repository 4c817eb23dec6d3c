"""KV + Mamba through L3 with 2 TP ranks (two processes over gloo): the ranks agree with MIN on
how much of a prefix to use and end with identical trees, whatever each rank's L3 holds.

Each rank stores its own shard (KV heads and Mamba state differ per rank, so do the keys). L3
holds AB with states after A and after AB; after a flush both ranks prefetch AB:

- ``full``: every page and state is there: AB comes back, bytes checked on each rank;
- ``one_rank_lost_a_state``: rank 1 lost the state after AB: both use A (the longest prefix
  with a state on every rank), with A's state;
- ``crossed_states``: rank 0 lost the state after A, rank 1 the one after AB: the agreed length
  (A) has no state on rank 0, its read misses there, and both refuse the hit.

The ranks issue the same number of collectives, and every slot is free after the final flush.
"""

import traceback
from datetime import timedelta

import pytest
import torch
from tree_fixtures import MAMBA_A, MAMBA_AB, mamba_l3_filled, snapshot

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix.tree_node import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_ranks

register_cpu_ci(est_time=10, suite="per-commit-cpu")

GROUP_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 120
LOST = {"full": {}, "one_rank_lost_a_state": {1: [3]}, "crossed_states": {0: [1], 1: [3]}}


def scenario(rank, group, tmp, name) -> dict:
    """Fill L3, drop this rank's lost states (page indices of AB), prefetch AB, load it back."""
    env, kv_ab, state_a, state_b, hashes = mamba_l3_filled(f"{tmp}/{name}", seed=10 + rank, tp_rank=rank,
                                                           tp_size=2, tp_cache_group=group)
    try:
        for page in LOST[name].get(rank, []):
            env.state_file(hashes[page]).unlink()
        torch.distributed.barrier(group)
        env.prefetch(MAMBA_AB)
        hit = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(MAMBA_AB))).host_hit_length
        bytes_ok = None
        if hit:
            _, slots, end = env.load_back(MAMBA_AB)
            got, got_state = snapshot(env.kv, slots), snapshot(env.mamba, end.mamba_value)
            state = state_b if hit == len(MAMBA_AB) else state_a
            bytes_ok = (all(torch.equal(got[c], kv_ab[c][:, :hit]) for c in kv_ab)
                        and all(torch.equal(got_state[c], state[c]) for c in state))
        env.tree.check_integrity()
        stats = env.l3()
        env.close()  # asserts every slot is free
        return {"hit": hit, "bytes_ok": bytes_ok, "calls": env.tree.agreement.num_calls,
                "state_misses": stats["prefetch_state_misses"], "found": stats["prefetch_pages_found"]}
    except BaseException:
        env.controller.close()
        raise


def _worker(rank: int, port: int, tmp: str, out) -> None:
    import torch.distributed as dist

    results = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        for name in LOST:
            try:
                results[name] = scenario(rank, group, tmp, name)
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"crash": traceback.format_exc()}
    except BaseException:
        results["crash"] = traceback.format_exc()
    out.put(results)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = run_ranks(_worker, str(tmp_path_factory.mktemp("mamba_l3_tp")), timeout_s=JOIN_TIMEOUT_S)
    assert sorted(results) == [0, 1], f"ranks reported {sorted(results)} (hang or crash)"
    for res in results.values():
        assert "crash" not in res, res["crash"]
    return results


def records(ranks, name):
    recs = [ranks[r][name] for r in (0, 1)]
    for rec in recs:
        assert "crash" not in rec, rec["crash"]
    assert recs[0]["calls"] == recs[1]["calls"], "ranks issued different numbers of collectives"
    assert recs[0]["hit"] == recs[1]["hit"], "ranks disagree on the hit"
    return recs


def test_every_page_and_state_comes_back_on_both_ranks(ranks):
    for rec in records(ranks, "full"):
        assert (rec["hit"], rec["bytes_ok"], rec["found"], rec["state_misses"]) == (len(MAMBA_AB), True, 4, 0)


def test_one_rank_without_the_deep_state_trims_both_to_the_shared_state(ranks):
    r0, r1 = records(ranks, "one_rank_lost_a_state")
    assert (r0["hit"], r0["bytes_ok"], r1["bytes_ok"]) == (len(MAMBA_A), True, True)
    assert (r0["found"], r1["found"]) == (2, 2)  # agreed: MIN(4, 2)


def test_a_state_missing_at_the_agreed_length_refuses_the_hit_everywhere(ranks):
    r0, r1 = records(ranks, "crossed_states")
    assert (r0["hit"], r0["bytes_ok"], r1["bytes_ok"]) == (0, None, None)
    assert (r0["state_misses"], r1["state_misses"]) == (1, 0)  # rank 0 had no state after A


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
