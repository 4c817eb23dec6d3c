"""L3 pages belong to the weights, not to a directory name: checkpoint B copied over checkpoint A's
directory and served with A's L3 directory reads none of A's pages and answers exactly as B
without HiCache; A's checkpoint at another path, served under the same name, reads A's pages (the
namespace's model identity is ``<served name>@<checkpoint fingerprint>``, docs/storage_keys.md)."""

import json
import os
import shutil

from test_hicache_storage import wait_backed_up

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=35, suite="per-commit-cpu")

PROMPT = list(range(100, 260))  # 160 tokens: 40 pages of 4
GREEDY = {"max_new_tokens": 8, "temperature": 0}
COMMON = ("--page-size", "4", "--context-length", "2048", "--max-total-tokens", "512")


def serve_with_l3(model, storage_dir):
    return launch_server_process(
        model, *COMMON, "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"storage_dir": storage_dir, "prefetch_threshold": 4}))


def generate(server) -> dict:
    return server.generate(input_ids=PROMPT, sampling_params=GREEDY)


def put_checkpoint(src, dst):
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return str(dst)


def test_other_weights_in_the_same_directory_never_read_its_pages(tmp_path):
    ckpt_a = make_tiny_model(str(tmp_path / "a"), "qwen3", "--seed", "0")
    ckpt_b = make_tiny_model(str(tmp_path / "b"), "qwen3", "--seed", "1")
    with open(os.path.join(ckpt_a, "config.json")) as fa, open(os.path.join(ckpt_b, "config.json")) as fb:
        assert json.load(fa) == json.load(fb)  # same architecture and sizes: only the weights differ
    l3, served = str(tmp_path / "l3"), tmp_path / "final"

    with serve_with_l3(put_checkpoint(ckpt_a, served), l3) as server_a:
        want_a = generate(server_a)
        assert wait_backed_up(server_a) >= 39

    with serve_with_l3(put_checkpoint(ckpt_b, served), l3) as server_b:
        got_b = generate(server_b)
    with launch_server_process(ckpt_b, *COMMON) as plain_b:
        want_b = generate(plain_b)
    assert got_b["meta_info"]["cached_tokens_details"]["storage"] == 0, got_b["meta_info"]
    assert got_b["output_ids"] == want_b["output_ids"]
    assert want_b["output_ids"] != want_a["output_ids"]  # A's pages would have shown

    # the same checkpoint at another path (same served name: the basename) shares the pages
    with serve_with_l3(put_checkpoint(ckpt_a, tmp_path / "elsewhere" / "final"), l3) as copy_a:
        got_a = generate(copy_a)
    assert got_a["meta_info"]["cached_tokens_details"]["storage"] >= 156, got_a["meta_info"]
    assert got_a["output_ids"] == want_a["output_ids"]
