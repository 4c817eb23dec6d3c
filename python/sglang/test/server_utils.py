"""Launch and stop a real server process for tests and benchmarks.

``launch_server_process(model_path, *flags)`` runs ``python -m sglang.launch_server`` on a free
port of 127.0.0.1 in its own process group, waits for ``/health``, and returns a handle whose
``stop()`` terminates the whole group (schedulers included). Start-up failures raise with the
tail of the server log; every wait has a deadline, so nothing hangs. The server gets
``--admin-api-key TEST_ADMIN_API_KEY`` unless the flags name one, and the handle's ``get`` /
``post`` send that key when given no headers, so tests reach the admin routes (``/flush_cache``,
L3 attach / detach) as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import requests

from sglang.test.engine_utils import REPO_ROOT
from sglang.test.multiprocess import free_port


TEST_ADMIN_API_KEY = "sglang-test-admin-key"


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    admin_headers: dict = {}  # Authorization of the admin key (set by launch_server_process)

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def post(self, path: str, json=None, timeout: float = 120, **kwargs) -> requests.Response:
        kwargs.setdefault("headers", self.admin_headers)
        return requests.post(self.url + path, json=json, timeout=timeout, **kwargs)

    def get(self, path: str, timeout: float = 30, **kwargs) -> requests.Response:
        kwargs.setdefault("headers", self.admin_headers)
        return requests.get(self.url + path, timeout=timeout, **kwargs)

    def generate(self, input_ids=None, text=None, timeout: float = 120, **fields) -> dict:
        body = {"input_ids": input_ids} if input_ids is not None else {"text": text}
        resp = self.post("/generate", {**body, **fields}, timeout=timeout)
        if resp.status_code != 200:
            raise AssertionError(f"/generate -> {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc, signal.SIGKILL)  # schedulers too, whatever the launcher did
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def server_env(extra: dict | None = None) -> dict:
    """The environment of a test server: one OpenMP thread (bit-identical batch-invariant
    outputs need it on CPU, and tests share the machine), ``python/`` on the path."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    python_dir = os.path.join(REPO_ROOT, "python")
    env["PYTHONPATH"] = python_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def run_launcher(model_path: str, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run the launcher to completion (for start-up errors); returns its exit status and output."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(free_port()),
           *flags]
    return subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=timeout_s,
                          start_new_session=True)


def start_process(cmd: list[str], port: int, ready, what: str, timeout_s: float, env: dict | None = None,
                  log_dir: str | None = None, handle=ServerProcess) -> ServerProcess:
    """Start ``cmd`` in its own process group, logging to a temp file, and return
    ``handle(proc, port, log)`` once ``ready(url)`` is true; ServerStartError (with the log tail)
    if it exits first or is not ready within ``timeout_s``."""
    fd, log_path = tempfile.mkstemp(prefix=f"sglang-{what}-{port}-", suffix=".log", dir=log_dir)
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(env),
                                start_new_session=True)
    server = handle(proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise ServerStartError(f"{what} exited with {proc.returncode}:\n{server.log_tail()}")
        if ready(server.url):
            return server
        time.sleep(0.1)
    server.stop()
    raise ServerStartError(f"{what} not ready after {timeout_s} s:\n{server.log_tail()}")


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def launch_server_process(model_path: str, *flags: str, timeout_s: float = 120, env: dict | None = None,
                          log_dir: str | None = None) -> ServerProcess:
    port = free_port()
    if "--admin-api-key" not in flags:
        flags = (*flags, "--admin-api-key", TEST_ADMIN_API_KEY)
    admin_key = flags[flags.index("--admin-api-key") + 1]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port), *flags]
    server = start_process(cmd, port, _healthy, "server", timeout_s, env=env, log_dir=log_dir)
    server.admin_headers = {"Authorization": f"Bearer {admin_key}"}
    return server
