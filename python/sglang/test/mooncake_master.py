"""A real ``mooncake_master`` for tests: 127.0.0.1, free ports, stopped by its pid.

The master serves its RPC port and, embedded, the HTTP metadata server the clients' transfer
engines use; its admin/metrics port (9003 by default) gets a free port too, so several masters
(parallel test files) never collide. :meth:`MooncakeMaster.restart` brings it back on the same
ports, which is what clients of a restarted master see in production.

``mooncake_or_skip()`` imports the Mooncake store client, or skips the calling test module when
the wheel (the ``mooncake`` extra) or its system libraries (Debian's ``libibverbs1`` and
``librdmacm1``) are missing; with ``SGLANG_TEST_REQUIRE_MOONCAKE=1`` (CI) it fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time

from sglang.test.multiprocess import free_port

REQUIRE_ENV = "SGLANG_TEST_REQUIRE_MOONCAKE"


def mooncake_or_skip():
    """``mooncake.store`` (the module), or a pytest skip (a failure under SGLANG_TEST_REQUIRE_MOONCAKE=1)
    naming what is missing."""
    import pytest

    try:
        import mooncake.store as store
    except ImportError as exc:  # the wheel, or libibverbs.so.1 / librdmacm.so.1
        why = (f"Mooncake store unavailable ({exc}); install the 'mooncake' extra and Debian's "
               f"libibverbs1 and librdmacm1")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why, allow_module_level=True)
    return store


def master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped in the Mooncake wheel."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the mooncake package is not installed (pip install 'sglang[mooncake]')")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"no mooncake_master in {list(spec.submodule_search_locations)}")


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process. ``start()`` returns once its RPC and metadata ports accept
    connections; ``stop()`` / ``kill()`` end it by pid. Usable as a context manager."""

    def __init__(self, extra_args: tuple[str, ...] = (), start_timeout_s: float = 30.0):
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake_master_", suffix=".log", delete=False)

    @property
    def master_server_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def extra_config(self, global_segment_size: int = 64 << 20, **overrides) -> dict:
        """A backend's extra config for this master (TCP on 127.0.0.1)."""
        return {"master_server_address": self.master_server_address, "metadata_server": self.metadata_server,
                "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
                "global_segment_size": global_segment_size, **overrides}

    def command(self) -> list[str]:
        return [master_binary(), "-rpc_address", "127.0.0.1", "-rpc_port", str(self.rpc_port),
                "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
                "-http_metadata_server_port", str(self.http_port), "-metrics_host", "127.0.0.1",
                "-metrics_port", str(self.metrics_port), *self.extra_args]

    def start(self) -> "MooncakeMaster":
        if self.running:
            return self
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while not (_accepts(self.rpc_port) and _accepts(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master did not start on ports {self.rpc_port}/{self.http_port}; "
                                   f"log tail:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _signal(self, sig: int, timeout_s: float) -> None:
        if not self.running:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by pid, SIGKILL if it has not exited within ``timeout_s``."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL by pid: the master vanishes without notice (what clients must survive)."""
        self._signal(signal.SIGKILL, 10.0)

    def restart(self) -> "MooncakeMaster":
        """A fresh master (empty store) on the same ports."""
        self.kill()
        return self.start()

    def log_tail(self, num_bytes: int = 4000) -> str:
        with open(self._log.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - num_bytes))
            return f.read().decode("utf-8", "replace")

    def close(self) -> None:
        self.stop()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
