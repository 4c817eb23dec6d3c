"""The PD NIXL agent's backend choice (upstream's SGLANG_DISAGGREGATION_NIXL_BACKEND / _PARAMS):
parameter parsing, the plugin check and agent creation, against real NIXL agents; every error
names the value given and what is allowed."""

import sys

import pytest
import torch

from sglang.srt.disaggregation.base import DisaggregationMode, KVArgs, TransferConfig
from sglang.srt.disaggregation.nixl.agent import create_pd_agent
from sglang.srt.disaggregation.nixl.conn import (
    NixlKVManager,
    load_nixl_agent_classes,
    parse_nixl_backend_params,
    validate_nixl_backend_available,
)
from sglang.srt.disaggregation.utils import transfer_config
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.mark.parametrize("raw,params", [
    ("{}", {}),
    ('{"num_workers": "2", "ucx_devices": ""}', {"num_workers": "2", "ucx_devices": ""}),
])
def test_params_parse_to_a_dict_of_strings(raw, params):
    assert parse_nixl_backend_params(raw) == params


@pytest.mark.parametrize("raw,match", [
    ('{"num_workers": ', r"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS must be valid JSON, got '\{\"num_workers\": '"),
    ("", "must be valid JSON"),
    ('"UCX"', "must be a JSON object of parameter name to string value, got str: 'UCX'"),
    ("[1, 2]", "must be a JSON object of parameter name to string value, got list"),
    ('{"num_workers": 2}', "must have string keys and string values .* got 'num_workers': 2"),
    ('{"num_workers": null}', "got 'num_workers': None"),
])
def test_bad_params_name_the_source_the_value_and_the_form(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_nixl_backend_params(raw)


def test_params_errors_name_the_given_source():
    with pytest.raises(ValueError, match="--my-flag must be valid JSON"):
        parse_nixl_backend_params("{", source="--my-flag")


def test_loads_the_real_agent_classes():
    from nixl._api import nixl_agent, nixl_agent_config

    assert load_nixl_agent_classes() == (nixl_agent, nixl_agent_config)


def test_missing_nixl_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes the import raise ImportError
    with pytest.raises(ImportError, match="Please install NIXL .*nixl transfer backend") as info:
        load_nixl_agent_classes()
    assert isinstance(info.value.__cause__, ImportError)


@pytest.fixture(scope="module")
def bare_agent():
    nixl_agent, nixl_agent_config = load_nixl_agent_classes()
    return nixl_agent("bare", nixl_agent_config(enable_prog_thread=False, backends=[]))


def test_an_installed_plugin_passes_and_the_list_comes_back(bare_agent):
    plugins = validate_nixl_backend_available(bare_agent, "UCX")
    assert "UCX" in plugins and plugins == list(bare_agent.get_plugin_list())


def test_a_missing_plugin_is_refused_naming_the_installed_ones(bare_agent):
    installed = list(bare_agent.get_plugin_list())
    with pytest.raises(ValueError) as info:
        validate_nixl_backend_available(bare_agent, "NO_SUCH_PLUGIN")
    msg = str(info.value)
    assert msg.startswith("NIXL backend 'NO_SUCH_PLUGIN' is not installed; available plugins: ")
    assert str(installed) in msg and "SGLANG_DISAGGREGATION_NIXL_BACKEND" in msg


def test_agent_is_made_with_exactly_the_chosen_backend_and_params():
    agent = create_pd_agent("chosen", TransferConfig(nixl_backend_params={"num_workers": "2"}))
    assert list(agent.backends) == ["UCX"]
    assert agent.backend_options["UCX"]["num_workers"] == "2"


@pytest.mark.parametrize("config,match", [
    (TransferConfig(nixl_backend="NO_SUCH_PLUGIN"), "NIXL backend 'NO_SUCH_PLUGIN' is not installed; available"),
    (TransferConfig(nixl_backend_params={"num_workers": "many"}),
     r"NIXL could not create backend 'UCX' with params \{'num_workers': 'many'\}"),
])
def test_agent_creation_errors_name_backend_and_params(config, match):
    with pytest.raises(ValueError, match=match):
        create_pd_agent("refused", config)


def test_manager_makes_its_agent_with_the_configured_backend():
    pool = MHATokenToKVPool(16, 4, torch.float32, 2, 4, 1)
    args = KVArgs.from_pools(pool, engine_rank=0, total_kv_head_num=2)
    with pytest.raises(ValueError, match="NIXL backend 'NO_SUCH_PLUGIN' is not installed"):
        NixlKVManager(args, DisaggregationMode.DECODE, TransferConfig(nixl_backend="NO_SUCH_PLUGIN"))
    with NixlKVManager(args, DisaggregationMode.DECODE, TransferConfig(nixl_backend_params={"num_workers": "2"})) as m:
        assert list(m.agent.backends) == ["UCX"] and m.agent.backend_options["UCX"]["num_workers"] == "2"


@pytest.mark.parametrize("field,value,match", [
    ("nixl_backend", "", "TransferConfig.nixl_backend must be a NIXL plugin name such as 'UCX', got ''"),
    ("nixl_backend", None, "got None"),
    ("nixl_backend_params", {"num_workers": 2}, "TransferConfig.nixl_backend_params must have string keys"),
    ("nixl_backend_params", '{"a": "b"}', "must be a JSON object of parameter name to string value, got str"),
])
def test_transfer_config_refuses_bad_backend_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(**{field: value})


def test_server_config_reads_upstreams_environment(monkeypatch):
    monkeypatch.delenv("SGLANG_DISAGGREGATION_NIXL_BACKEND", raising=False)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", raising=False)
    cfg = transfer_config("127.0.0.1", None)
    assert (cfg.nixl_backend, cfg.nixl_backend_params) == ("UCX", {})
    monkeypatch.setenv("SGLANG_DISAGGREGATION_NIXL_BACKEND", "LIBFABRIC")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", '{"num_threads": "4"}')
    cfg = transfer_config("127.0.0.1", None)
    assert (cfg.nixl_backend, cfg.nixl_backend_params) == ("LIBFABRIC", {"num_threads": "4"})
    monkeypatch.setenv("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", '{"num_threads": 4}')
    with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS must have string keys"):
        transfer_config("127.0.0.1", None)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
