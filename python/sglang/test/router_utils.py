"""Launch and stop the real sglang router (``sglang-router`` from PyPI) in front of servers.

``launch_router(worker_urls)`` runs ``python -m sglang_router.launch_router`` bound to
127.0.0.1 (its Prometheus endpoint too) on free ports, in its own process group, and waits
until a request routed through it succeeds; ``stop()`` ends the whole group. Every wait has a
deadline and a start-up failure raises with the tail of the router log.
"""

from __future__ import annotations

import sys

import requests

from sglang.test.multiprocess import free_port
from sglang.test.server_utils import ServerProcess, start_process


class RouterProcess(ServerProcess):
    """A router; the same handle (``url``, ``post``, ``get``, ``generate``, ``stop``) as a server."""


def _routes_requests(url: str) -> bool:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        return requests.post(url + "/generate", json=body, timeout=10).status_code == 200
    except requests.RequestException:
        return False


def launch_router(worker_urls: list[str], policy: str = "cache_aware", *flags: str,
                  timeout_s: float = 60) -> RouterProcess:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port), "--log-level", "warn", *flags]
    return start_process(cmd, port, _routes_requests, "router", timeout_s, handle=RouterProcess)


def launch_pd_router(prefills: list[tuple[str, int | None]], decode_urls: list[str], *flags: str,
                     timeout_s: float = 60, log_dir: str | None = None) -> RouterProcess:
    """The router in PD mode: ``prefills`` are (url, bootstrap port or None) pairs, then the
    decode servers. Ready once a /generate through it (prefill + decode) succeeds."""
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap_port in prefills:
        cmd += ["--prefill", url, "none" if bootstrap_port is None else str(bootstrap_port)]
    for url in decode_urls:
        cmd += ["--decode", url]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "warn", *flags]
    return start_process(cmd, port, _routes_requests, "router", timeout_s, log_dir=log_dir, handle=RouterProcess)
