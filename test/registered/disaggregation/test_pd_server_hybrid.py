"""PD serving of a hybrid model (KV + per-request state) through the real sglang-router in PD
mode, tp 1 -> 1: a tiny Qwen3-Next (2 layers: one linear-attention layer with a Mamba conv and
temporal state slot per request, one full-attention layer with paged KV). A short prompt and one
spanning several pages, then a 3-turn workload, are token-identical to a plain server of the
same cache configuration (which equals HF transformers: hicache/test_qwen3_next_e2e.py), and both
PD servers settle with no failure, no open room and a passed idle integrity check (state slots
included). Heterogeneous TP, HiCache on prefill and the sidecar models run nightly
(test_pd_server_hybrid_nightly.py)."""

import pytest

from pd_cluster import check_pd_pair
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=15, suite="per-commit-cpu")

FLAGS = ("--disable-radix-cache", "--page-size", "16")
PROMPTS = [[12 + (i * 19) % 800 for i in range(5)], [40 + (i * 23) % 700 for i in range(45)]]  # < 1 page, ~3 pages


def test_qwen3_next_tp1_to_tp1_outputs_identical(tmp_path):
    model = make_tiny_model(str(tmp_path / "qwen3_next"), "qwen3_next", "--layers", "2")
    check_pd_pair(model, None, 1, 1, PROMPTS, log_dir=str(tmp_path), flags=FLAGS, reference_flags=FLAGS)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
