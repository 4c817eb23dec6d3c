"""With default flags (no prefetch policy named: upstream's ``timeout``), a restarted server on
the same L3 directory serves a prompt it saw before from storage, idle as it is: the request
waits (within the timeout budget) for its prefetch instead of being scheduled before any page
arrived, as ``best_effort`` did (0 storage tokens)."""

import json

from test_hicache_storage import wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=20, suite="per-commit-cpu")

PROMPT = list(range(100, 260))  # 160 tokens: 40 pages of 4


def serve(model, storage_dir):
    return launch_server_process(
        model, "--page-size", "4", "--context-length", "2048", "--max-total-tokens", "512",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"storage_dir": storage_dir, "prefetch_threshold": 4}))


def test_a_restarted_idle_server_reads_its_l3_with_default_flags(model, tmp_path):
    l3 = str(tmp_path / "l3")
    with serve(model, l3) as first:
        want = first.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert wait_backed_up(first) > 0
    with serve(model, l3) as second:
        info = second.get("/get_server_info").json()
        assert info["hicache_storage_prefetch_policy"] == "timeout"
        got = second.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert got["output_ids"] == want["output_ids"]
    details = got["meta_info"]["cached_tokens_details"]
    assert details["storage"] >= 156, details  # every whole page of the prompt but the last token's
