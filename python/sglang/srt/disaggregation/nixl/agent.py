"""The PD NIXL agent: which plugin moves the KV (upstream's ``SGLANG_DISAGGREGATION_NIXL_BACKEND``,
UCX by default) and with which init parameters (``..._BACKEND_PARAMS``, a JSON object of strings).

``create_pd_agent`` is the one place a ``NixlKVManager`` gets its agent: the agent starts with no
backend, the requested plugin is checked against the installed ones (a ValueError lists them),
then created with its parameters. ``nixl`` is imported here, on first use, never at module import.
"""

from __future__ import annotations

import json
import logging

from sglang.srt.disaggregation.base.conn import TransferConfig, check_nixl_backend_params

logger = logging.getLogger(__name__)

ENV_NIXL_BACKEND = "SGLANG_DISAGGREGATION_NIXL_BACKEND"
ENV_NIXL_BACKEND_PARAMS = "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"


def load_nixl_agent_classes():
    """``(nixl_agent, nixl_agent_config)`` from the NIXL Python API; ImportError with install
    guidance when NIXL is missing."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError(
            "Please install NIXL (pip install nixl, or see https://github.com/ai-dynamo/nixl) to run "
            f"PD disaggregation with the nixl transfer backend: {exc}"
        ) from exc
    return nixl_agent, nixl_agent_config


def parse_nixl_backend_params(raw: str, source: str = ENV_NIXL_BACKEND_PARAMS) -> dict[str, str]:
    """The backend init parameters ``raw`` names: a JSON object of strings, e.g.
    ``'{"num_threads": "4"}'``. ValueError (naming ``source``) on anything else."""
    try:
        params = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} must be valid JSON, got {raw!r}: {exc}") from None
    check_nixl_backend_params(params, source)
    return params


def validate_nixl_backend_available(agent, backend: str) -> list[str]:
    """The agent's installed plugins; ValueError naming ``backend`` and them when it is not one."""
    plugins = list(agent.get_plugin_list())
    if backend not in plugins:
        raise ValueError(f"NIXL backend {backend!r} is not installed; available plugins: {plugins}. "
                         f"Set {ENV_NIXL_BACKEND} to one of them or install the plugin.")
    return plugins


def create_pd_agent(name: str, config: TransferConfig):
    """A NIXL agent named ``name`` with exactly ``config.nixl_backend`` created, with
    ``config.nixl_backend_params``. ValueError when the plugin is missing or refuses the params."""
    nixl_agent, nixl_agent_config = load_nixl_agent_classes()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=config.nixl_progress_thread, backends=[]))
    backend, params = config.nixl_backend, dict(config.nixl_backend_params)
    validate_nixl_backend_available(agent, backend)
    try:
        agent.create_backend(backend, params)
    except Exception as exc:  # the binding raises bare nixl errors
        raise ValueError(f"NIXL could not create backend {backend!r} with params {params}: {exc!r}") from None
    logger.info("NIXL agent %s: backend %s, params %s", name, backend, params)
    return agent
