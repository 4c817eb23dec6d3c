"""ServerArgs: the CLI takes its defaults from the dataclass; every bad value or combination
stops with a message naming the flag, the value and what is allowed."""

import dataclasses
import json
import logging

import pytest

from sglang.srt.mem_cache.evict_policy import EvictionPolicy
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import EVICTION_POLICIES, ServerArgs, load_extra_config, parse_args
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

M = ["--model-path", "/models/x"]


def args(*argv: str) -> ServerArgs:
    return parse_args([*M, *argv])


def test_cli_defaults_are_the_dataclass_defaults():
    parsed = args()
    for f in dataclasses.fields(ServerArgs):
        if f.name != "model_path":
            assert getattr(parsed, f.name) == f.default, f.name
    assert parsed.host == "127.0.0.1" and parsed.hicache_write_policy == "write_through"


def test_every_field_has_a_flag_and_the_issue_flags_exist():
    parsed = args("--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--tp-size", "2",
                  "--page-size", "16", "--max-total-tokens", "4096", "--chunked-prefill-size", "512",
                  "--host", "0.0.0.0", "--port", "8080", "--enable-hierarchical-cache", "--hicache-ratio", "3",
                  "--hicache-size", "0", "--hicache-write-policy", "write_back", "--hicache-io-backend", "kernel",
                  "--hicache-mem-layout", "page_head", "--hicache-storage-backend", "file",
                  "--hicache-storage-prefetch-policy", "wait_complete",
                  "--hicache-storage-backend-extra-config", '{"storage_dir": "/tmp/x"}')
    assert (parsed.tp_size, parsed.page_size, parsed.port, parsed.hicache_ratio) == (2, 16, 8080, 3.0)
    assert parsed.storage_extra_config == {"storage_dir": "/tmp/x"}
    assert parsed.hicache_mem_layout == "page_head" and parsed.resolved_io_backend == "kernel"


def test_closed_sets_match_the_cache_enums():
    assert set(EVICTION_POLICIES) == {p.value for p in EvictionPolicy}


@pytest.mark.parametrize("argv, words", [
    (["--tp-size", "0"], ["--tp-size", "0", ">= 1"]),
    (["--page-size", "0"], ["--page-size"]),
    (["--max-total-tokens", "3", "--page-size", "4"], ["--max-total-tokens", "3", "--page-size"]),
    (["--chunked-prefill-size", "0"], ["--chunked-prefill-size", "-1"]),
    (["--port", "70000"], ["--port", "70000"]),
    (["--mem-fraction-static", "1.5"], ["--mem-fraction-static", "(0, 1]"]),
    (["--enable-hierarchical-cache", "--hicache-ratio", "0"], ["--hicache-ratio", "> 0"]),
    (["--enable-hierarchical-cache", "--hicache-size", "-1"], ["--hicache-size"]),
    (["--enable-hierarchical-cache", "--disable-radix-cache"], ["--disable-radix-cache"]),
    (["--hicache-storage-backend", "file"], ["--hicache-storage-backend", "--enable-hierarchical-cache"]),
    (["--enable-hierarchical-cache", "--hicache-storage-backend-extra-config", "{}"],
     ["--hicache-storage-backend-extra-config needs --hicache-storage-backend"]),
    (["--enable-hierarchical-cache", "--hicache-mem-layout", "page_head"],
     ["page_head", "direct", "the default on --device cpu", "page_head+kernel"]),
    (["--enable-hierarchical-cache", "--hicache-mem-layout", "page_head", "--hicache-io-backend", "direct"],
     ["--hicache-mem-layout page_head", "--hicache-io-backend direct", "layer_first+direct"]),
])
def test_invalid_values_name_flag_and_allowed(argv, words):
    with pytest.raises(ValueError) as err:
        args(*argv)
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.parametrize("field, value", [
    ("load_format", "pickle"), ("device", "tpu"), ("hicache_write_policy", "sometimes"),
    ("hicache_mem_layout", "diagonal"), ("hicache_io_backend", "dma"), ("radix_eviction_policy", "random"),
    ("hicache_storage_prefetch_policy", "eager"),
])
def test_choices_checked_for_programmatic_use(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} '{value}' is not allowed; choose one of"):
        ServerArgs(model_path="/m", **{field: value})


def test_unknown_storage_backend_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        args("--enable-hierarchical-cache", "--hicache-storage-backend", "tape")
    for name in StorageBackendFactory.known_backends():
        assert name in str(err.value)


def test_cli_rejects_bad_choice_with_usage(capsys):
    with pytest.raises(SystemExit) as err:
        args("--hicache-write-policy", "sometimes")
    assert err.value.code == 2
    assert "--hicache-write-policy" in capsys.readouterr().err


def test_direct_with_page_first_becomes_page_first_direct(caplog):
    with caplog.at_level(logging.WARNING):
        parsed = args("--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
                      "--hicache-io-backend", "direct")
    assert parsed.hicache_mem_layout == "page_first_direct"
    assert "page_first_direct" in caplog.text
    on_cpu_default = args("--enable-hierarchical-cache", "--hicache-mem-layout", "page_first")
    assert on_cpu_default.hicache_mem_layout == "page_first_direct"  # CPU default io is direct
    kernel = args("--enable-hierarchical-cache", "--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel")
    assert kernel.hicache_mem_layout == "page_first"


def test_extra_config_json_and_files(tmp_path):
    assert load_extra_config('{"a": 1}') == {"a": 1}
    assert load_extra_config(None) == {} and load_extra_config("") == {}
    (tmp_path / "c.json").write_text(json.dumps({"storage_dir": "/d", "capacity_gb": 2}))
    assert load_extra_config(f"@{tmp_path / 'c.json'}") == {"storage_dir": "/d", "capacity_gb": 2}
    (tmp_path / "c.toml").write_text('storage_dir = "/d"\n[plugin_params]\nbucket = "b"\n')
    assert load_extra_config(f"@{tmp_path / 'c.toml'}") == {"storage_dir": "/d", "plugin_params": {"bucket": "b"}}
    parsed = args("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                  "--hicache-storage-backend-extra-config", f"@{tmp_path / 'c.toml'}")
    assert parsed.storage_extra_config["storage_dir"] == "/d"
    for name in ("c.yaml", "c.yml"):  # upstream's third format
        (tmp_path / name).write_text("storage_dir: /d\nplugin_params:\n  bucket: b\nprefetch_threshold: 256\n")
        assert load_extra_config(f"@{tmp_path / name}") == {"storage_dir": "/d", "plugin_params": {"bucket": "b"},
                                                            "prefetch_threshold": 256}


@pytest.mark.parametrize("make, words", [
    (lambda d: "{bad", ["not valid JSON"]),
    (lambda d: "[1, 2]", ["must be a JSON/YAML/TOML object"]),
    (lambda d: f"@{d / 'missing.json'}", ["cannot read the file"]),
    (lambda d: f"@{d / 'c.ini'}", [".json, .yaml, .yml, .toml"]),
    (lambda d: (d / "bad.yaml").write_text("a: [1, 2") and f"@{d / 'bad.yaml'}", ["not valid YAML"]),
    (lambda d: (d / "list.yaml").write_text("- 1\n- 2\n") and f"@{d / 'list.yaml'}", ["must be a JSON/YAML/TOML object"]),
    (lambda d: (d / "obj.yaml").write_text("a: !!python/object:os.system {}\n") and f"@{d / 'obj.yaml'}",
     ["not valid YAML"]),
    (lambda d: (d / "bad.toml").write_text("= nope") and f"@{d / 'bad.toml'}", ["not valid TOML"]),
])
def test_extra_config_errors_name_the_flag(tmp_path, make, words):
    with pytest.raises(ValueError) as err:
        args("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", make(tmp_path))
    assert "--hicache-storage-backend-extra-config" in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_check_model_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--model-path .* is not a directory"):
        ServerArgs(model_path=str(tmp_path / "nope")).check_model()
    with pytest.raises(ValueError, match="has no config.json"):
        ServerArgs(model_path=str(tmp_path)).check_model()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT9"]}))
    with pytest.raises(ValueError, match="GPT9.*supported"):
        ServerArgs(model_path=str(tmp_path)).check_model()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ServerArgs(model_path=str(tmp_path)).check_model()
    (tmp_path / "config.json").write_text("not json")
    with pytest.raises(ValueError, match="config.json is not a JSON object"):
        ServerArgs(model_path=str(tmp_path)).check_model()


def test_every_flag_is_documented():
    from sglang.test.engine_utils import REPO_ROOT

    with open(f"{REPO_ROOT}/docs/server.md") as f:
        docs = f.read()
    missing = [f.name for f in dataclasses.fields(ServerArgs) if f"`--{f.name.replace('_', '-')}`" not in docs]
    assert not missing, f"flags missing from docs/server.md: {missing}"


def test_upstream_compatibility_flags_are_accepted(tmp_path):
    parsed = args("--enable-metrics", "--enable-cache-report", "--trust-remote-code", "--disable-hicache-numa-detect",
                  "--tokenizer-path", str(tmp_path), "--served-model-name", "m", "--mem-fraction-static", "0.7",
                  "--log-level", "critical")
    assert parsed.enable_metrics and parsed.enable_cache_report and parsed.trust_remote_code
    assert parsed.disable_hicache_numa_detect and parsed.tokenizer_path == str(tmp_path)
    assert (parsed.model_name, parsed.mem_fraction_static, parsed.log_level) == ("m", 0.7, "critical")
    assert args().hicache_storage_prefetch_policy == "timeout"  # upstream 0.5.23's default


def test_tokenizer_path_is_checked_instead_of_the_model_directory(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="--tokenizer-path .* has no tokenizer.json"):
        ServerArgs(model_path=str(model), tokenizer_path=str(tmp_path)).check_model()
    (tmp_path / "tokenizer.json").write_text("{}")
    ServerArgs(model_path=str(model), tokenizer_path=str(tmp_path)).check_model()


def test_pass_prefix_keys_is_a_controller_key():
    parsed = args("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                  "--hicache-storage-backend-extra-config", '{"hicache_storage_pass_prefix_keys": true}')
    from sglang.srt.mem_cache.controller.storage_settings import split_extra_config

    settings, backend = split_extra_config(parsed.storage_extra_config)
    assert settings.hicache_storage_pass_prefix_keys is True and backend == {}
    with pytest.raises(ValueError, match="hicache_storage_pass_prefix_keys.*boolean"):
        split_extra_config({"hicache_storage_pass_prefix_keys": 1})


def test_the_npu_layout_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="page_first_kv_split is refused: it is upstream's Ascend NPU layout"):
        args("--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_kv_split")


@pytest.mark.parametrize("argv, words", [
    ([], ["--disaggregation-decode-enable-offload-kvcache", "only for --disaggregation-mode decode", "'null'"]),
    (["--disaggregation-mode", "prefill", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
     ["--disaggregation-decode-enable-offload-kvcache", "only for --disaggregation-mode decode", "'prefill'"]),
    (["--disaggregation-mode", "decode"],
     ["--disaggregation-decode-enable-offload-kvcache needs --hicache-storage-backend", "prefill servers"]),
    (["--disaggregation-mode", "decode", "--hicache-storage-backend", "file", "--disable-radix-cache"],
     ["--disaggregation-decode-enable-offload-kvcache needs the radix cache", "--disable-radix-cache"]),
    (["--disaggregation-mode", "decode", "--hicache-storage-backend", "file", "--hicache-write-policy", "write_back"],
     ["--disaggregation-decode-enable-offload-kvcache needs --hicache-write-policy write_through", "'write_back'"]),
])
def test_decode_offload_is_refused_without_decode_mode_and_l3(argv, words):
    with pytest.raises(ValueError) as err:
        args("--disaggregation-decode-enable-offload-kvcache", *argv)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_decode_offload_turns_on_the_host_tier_as_its_staging_buffer():
    parsed = args("--disaggregation-mode", "decode", "--disaggregation-decode-enable-offload-kvcache",
                  "--hicache-storage-backend", "file")  # upstream's command line: no --enable-hierarchical-cache
    assert parsed.enable_hierarchical_cache and parsed.hicache_storage_backend == "file"
    assert not args("--disaggregation-mode", "decode").disaggregation_decode_enable_offload_kvcache
