"""The Mooncake backend's configuration, read as upstream reads it (extra config, then the file at
SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, then MOONCAKE_* variables), and the meaning of Mooncake's
return codes. No Mooncake needed."""

import json

import pytest

from sglang.srt.mem_cache.storage.mooncake_store.mooncake_config import parse_mooncake_options, parse_segment_size
from sglang.srt.mem_cache.storage.mooncake_store.store_client import Outcome, bound_tcp_timeouts, classify
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

ENVS = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_TE_META_DATA_SERVER",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE", "MOONCAKE_TENANT_ID",
        "MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENVS:  # set first, so that monkeypatch restores even what the code under test sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_extra_config_with_a_master_is_the_source():
    opts = parse_mooncake_options({"master_server_address": "10.0.0.1:50051",
                                   "metadata_server": "http://m:8080/metadata", "global_segment_size": "2gb",
                                   "protocol": "tcp", "local_hostname": "node-a", "transfer_timeout_s": 5,
                                   "namespace_salt": "x"})
    assert (opts.master_server_address, opts.metadata_server, opts.protocol, opts.local_hostname) == (
        "10.0.0.1:50051", "http://m:8080/metadata", "tcp", "node-a")
    assert opts.global_segment_size == 2 << 30 and opts.segment_bytes(tp_size=2, pp_size=2) == 512 << 20
    assert (opts.transfer_timeout_s, opts.source, opts.tenant_id, opts.device_name) == (
        5.0, "extra config", "default", "")


def test_upstream_defaults_and_env_fallbacks(monkeypatch):
    opts = parse_mooncake_options({"master_server_address": "m:1"})
    assert (opts.metadata_server, opts.global_segment_size, opts.protocol, opts.local_hostname) == (
        "P2PHANDSHAKE", 4 << 30, "rdma", "localhost")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")  # honoured when the config omits protocol
    monkeypatch.setenv("LOCAL_HOSTNAME", "from-local")
    opts = parse_mooncake_options({"master_server_address": "m:1", "local_hostname": "cfg"})
    assert opts.local_hostname == "from-local"
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "from-mooncake")  # per process, over any config
    opts = parse_mooncake_options({"master_server_address": "m:1", "local_hostname": "cfg"})
    assert (opts.protocol, opts.local_hostname) == ("tcp", "from-mooncake")


def test_config_file_then_environment(monkeypatch, tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "file:1", "protocol": "tcp", "tenant_id": "t"}))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("MOONCAKE_MASTER", "env:2")
    opts = parse_mooncake_options({"transfer_timeout_s": 7})  # own keys with another source
    assert (opts.master_server_address, opts.tenant_id, opts.transfer_timeout_s) == ("file:1", "t", 7.0)
    assert opts.source == f"file {path}"
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1024")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://e/metadata")
    opts = parse_mooncake_options({})
    assert (opts.master_server_address, opts.global_segment_size, opts.metadata_server, opts.source) == (
        "env:2", 1024, "http://e/metadata", "environment")


@pytest.mark.parametrize("extra,match", [
    ({}, "no master configured"),
    ({"protocol": "tcp"}, "without master_server_address"),
    ({"master_server_address": "m:1", "storage_dir": "/x"}, "unknown extra config key 'storage_dir'"),
    ({"master_server_address": "m:1", "standalone_storage": True}, "standalone_storage=True is not supported"),
    ({"master_server_address": "m:1", "enable_ssd_offload": True}, "enable_ssd_offload=True is not supported"),
    ({"master_server_address": "m:1", "global_segment_size": "4tb"}, "global_segment_size"),
    ({"master_server_address": "m:1", "transfer_timeout_s": 0}, "transfer_timeout_s"),
    ({"master_server_address": ""}, "master_server_address must be a non-empty string"),
])
def test_bad_configs_are_refused_naming_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        parse_mooncake_options(extra)


def test_neutral_upstream_keys_are_accepted():
    opts = parse_mooncake_options({"master_server_address": "m:1", "standalone_storage": False, "check_server": False,
                                   "master_metrics_port": 9003, "client_server_address": None})
    assert opts.master_server_address == "m:1"


def test_segment_sizes_and_device_per_rank():
    assert [parse_segment_size(v) for v in (0, "0", "3gb", " 2GB ", 4096)] == [0, 0, 3 << 30, 2 << 30, 4096]
    for bad in (-1, "x", "gb", True, 1.5):
        with pytest.raises(ValueError, match="global_segment_size"):
            parse_segment_size(bad)
    opts = parse_mooncake_options({"master_server_address": "m:1", "device_name": '{"0": "mlx5_0", "1": "mlx5_1"}'})
    assert [opts.device_for(r) for r in (0, 1, 2)] == ["mlx5_0", "mlx5_1", ""]
    assert parse_mooncake_options({"master_server_address": "m:1", "device_name": "mlx5_0"}).device_for(3) == "mlx5_0"


def test_return_codes():
    assert [classify(c) for c in (0, -704, -703, -712, -705, -900, -901, -800, -200, -600)] == [
        Outcome.OK, Outcome.ABSENT, Outcome.ABSENT, Outcome.ABSENT, Outcome.OK, Outcome.UNAVAILABLE,
        Outcome.UNAVAILABLE, Outcome.FAILED, Outcome.FAILED, Outcome.FAILED]
    assert [classify(c, expected=4160) for c in (4160, 4096, -600, -704)] == [
        Outcome.OK, Outcome.WRONG_SIZE, Outcome.WRONG_SIZE, Outcome.ABSENT]


def test_tcp_timeouts_follow_the_transfer_bound_unless_set(monkeypatch):
    import os

    bound_tcp_timeouts(30)
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "10"
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "99")
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC")
    bound_tcp_timeouts(2)
    assert (os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"], os.environ["MC_TCP_STATUS_TIMEOUT_SEC"]) == ("1", "99")
