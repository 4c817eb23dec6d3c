"""``python -m sglang.bench_serving`` against a real server (native and OpenAI backends): every
request succeeds, the JSONL line has upstream's fields and the token counts asked for; and the
helpers upstream's benchmark scripts import behave as they expect."""

import json
import subprocess
import sys

import numpy as np
import pytest

from sglang.bench_serving import (
    DatasetRow,
    RequestFuncInput,
    RequestFuncOutput,
    get_tokenizer,
    remove_prefix,
    sample_random_requests,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process, server_env

register_cpu_ci(est_time=15, suite="per-commit-cpu")

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, RATIO, SEED = 16, 48, 8, 0.5, 3
FIELDS = ("backend", "dataset_name", "request_rate", "max_concurrency", "random_input_len", "random_output_len",
          "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
          "input_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
          "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms",
          "median_e2e_latency_ms", "p90_e2e_latency_ms", "p99_e2e_latency_ms", "mean_tpot_ms")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture(scope="module")
def server(model):
    srv = launch_server_process(model, "--context-length", "2048", "--max-total-tokens", "4096")
    try:
        yield srv
    finally:
        srv.stop()


def run_bench(url: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--base-url", url, "--disable-tqdm", *flags]
    return subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=300)


def expected_output_tokens(model: str) -> int:
    """The output lengths the benchmark draws with the same seed (ignore_eos: all generated)."""
    np.random.seed(SEED)
    rows = sample_random_requests(INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS, RATIO, get_tokenizer(model), "",
                                  random_sample=False)
    return sum(r.output_len for r in rows)


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_completes_and_appends_jsonl(server, model, backend, tmp_path):
    out = tmp_path / "bench.jsonl"
    out.write_text('{"earlier": "line"}\n')
    proc = run_bench(server.url, "--backend", backend, "--dataset-name", "random", "--num-prompts", str(NUM_PROMPTS),
                     "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                     "--random-range-ratio", str(RATIO), "--request-rate", "40", "--max-concurrency", "4",
                     "--seed", str(SEED), "--output-file", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == {"earlier": "line"}  # appended, not overwritten
    record = json.loads(lines[1])
    missing = [k for k in FIELDS if k not in record]
    assert not missing, missing
    assert record["backend"] == backend and record["completed"] == NUM_PROMPTS and record["failed"] == 0
    assert record["total_output_tokens"] == expected_output_tokens(model)
    assert record["total_input_tokens"] > 0 and record["request_throughput"] > 0
    assert 0 < record["median_ttft_ms"] <= record["p99_ttft_ms"]
    assert record["median_e2e_latency_ms"] <= record["p99_e2e_latency_ms"]
    for title in ("Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):", "Median E2E Latency (ms):"):
        assert title in proc.stdout


def test_bench_serving_unreachable_server_fails_cleanly(model):
    proc = run_bench("http://127.0.0.1:9", "--tokenizer", model, "--model", "m", "--num-prompts", "2",
                     "--random-input-len", "8", "--random-output-len", "2")
    assert proc.returncode != 0 and "warmup failed" in proc.stderr


def test_sample_random_requests_lengths_and_ids(model):
    tok = get_tokenizer(model)
    np.random.seed(0)
    rows = sample_random_requests(32, 10, 20, 0.5, tok, "", random_sample=False, return_text=False)
    assert len(rows) == 20
    for row in rows:
        assert 16 <= row.prompt_len <= 32 and 5 <= row.output_len <= 10 and len(row.prompt) == row.prompt_len
        assert all(type(t) is int and 0 <= t < tok.vocab_size for t in row.prompt)
    prompt, prompt_len, output_len = rows[0]  # older scripts unpack rows as tuples
    assert rows[0][0] == prompt and (prompt_len, output_len) == (rows[0].prompt_len, rows[0].output_len)
    texts = sample_random_requests(32, 10, 3, 1.0, tok, "", random_sample=False)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 32 and r.output_len == 10 for r in texts)


def test_sharegpt_sampling_needs_a_local_file(model):
    with pytest.raises(ValueError, match="dataset-path"):
        sample_random_requests(8, 4, 2, 1.0, get_tokenizer(model), "", random_sample=True)


def test_get_tokenizer_offline_and_helpers(model, tmp_path):
    tok = get_tokenizer(model)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(np.array(ids)) == "hello world" and tok.vocab_size > 0
    assert get_tokenizer(f"{model}/tokenizer.json").encode("hello world", add_special_tokens=False) == ids
    assert isinstance(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False), str)
    with pytest.raises(ValueError, match="tokenizer.json"):
        get_tokenizer(str(tmp_path))
    assert remove_prefix("data: {}", "data: ") == "{}" and remove_prefix("x", "data: ") == "x"
    out = RequestFuncOutput.init_new(RequestFuncInput(prompt="p", api_url="u", prompt_len=7, output_len=3))
    assert (out.prompt_len, out.success, out.itl, out.cached_tokens, out.generated_len) == (7, False, [], 0, 0)
    assert DatasetRow("p", 1, 2).image_data is None


def test_cache_hit_kit_multiturn_payloads(server, model):
    """The payload-level helpers of ``sglang.test.kits.cache_hit_kit`` (what the newest upstream
    bench_multiturn imports): a second round over the history hits the cache."""
    import asyncio

    from sglang.test.kits.cache_hit_kit import (
        async_request_openai_chat_completions,
        async_request_sglang_generate,
        gen_payload,
        gen_payload_openai,
    )

    np.random.seed(SEED)
    history = list(sample_random_requests(40, 6, 1, 1.0, get_tokenizer(model), "", random_sample=False,
                                          return_text=False)[0].prompt)
    first = asyncio.run(async_request_sglang_generate(gen_payload(history, 6), server.url + "/generate"))
    assert first.success, first.error
    assert len(first.output_ids) == first.generated_len == 6 and first.prompt_len == 40 and first.ttft > 0
    history += first.output_ids + [5, 6, 7, 8]
    second = asyncio.run(async_request_sglang_generate(gen_payload(history, 6), server.url + "/generate"))
    assert second.success and second.prompt_len == len(history) and second.cached_tokens >= 40
    chat = asyncio.run(async_request_openai_chat_completions(
        gen_payload_openai([{"role": "user", "content": "hi there"}], 5, "m"), server.url + "/v1/chat/completions"))
    assert chat.success and 0 < chat.generated_len <= 5 and chat.output_ids == []
