"""L3 storage, the longer stories: a server restarted on the same storage directory serves the
conversation from storage; the NIXL backend (POSIX plugin) does what the file backend does; so
does a TP=2 server, whose ranks agree on every prefetch and backup."""

import pytest
from hicache_workload import assert_same_tokens, run_workload, tier_totals
from test_hicache_storage import COMMON, WORKLOAD, launch_storage_server, storage_flags, wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=45, suite="nightly-cpu")


@pytest.fixture(scope="module")
def reference(model):
    with launch_server_process(model, *COMMON, "--max-total-tokens", "16384") as srv:
        yield run_workload(srv, **WORKLOAD)


def test_restart_on_same_storage_directory(model, reference, tmp_path):
    storage_dir = str(tmp_path / "l3")
    with launch_storage_server(model, "file", storage_dir) as srv:
        run_workload(srv, **WORKLOAD)
        assert wait_backed_up(srv) > 0
    with launch_storage_server(model, "file", storage_dir) as srv:
        again = run_workload(srv, **WORKLOAD)
    assert_same_tokens(reference, again)
    assert tier_totals(again)["storage"] > 0


def test_nixl_backend_serves_after_flush(model, reference, tmp_path):
    pytest.importorskip("nixl")
    with launch_storage_server(model, "nixl", str(tmp_path / "nixl")) as srv:
        run_workload(srv, **WORKLOAD)
        assert wait_backed_up(srv) > 0
        assert srv.post("/flush_cache").status_code == 200
        again = run_workload(srv, **WORKLOAD)
    assert_same_tokens(reference, again)
    assert tier_totals(again)["storage"] > 0


def test_tp2_file_storage_serves_after_flush(model, reference, tmp_path):
    flags = [*storage_flags("file", str(tmp_path / "l3tp")), "--tp-size", "2"]
    with launch_server_process(model, *flags) as srv:
        run_workload(srv, **WORKLOAD)
        assert wait_backed_up(srv) > 0
        assert srv.post("/flush_cache").status_code == 200
        again = run_workload(srv, **WORKLOAD)
    assert_same_tokens(reference, again, logprob_tol=1e-4)
    assert tier_totals(again)["storage"] > 0
