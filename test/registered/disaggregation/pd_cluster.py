"""Real PD deployments for the server-level tests: prefill and decode servers (separate process
groups on 127.0.0.1), the real sglang-router in PD mode in front, and a plain server to compare
with. Servers start in parallel (each start is mostly model loading and imports).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from sglang.test.multiprocess import free_port
from sglang.test.router_utils import launch_pd_router
from sglang.test.server_utils import launch_server_process

BASE_FLAGS = ("--context-length", "2048", "--max-total-tokens", "4096", "--served-model-name", "tiny")


def prefill_flags(bootstrap_port: int, *extra: str) -> tuple[str, ...]:
    return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *extra)


def decode_flags(*extra: str) -> tuple[str, ...]:
    return ("--disaggregation-mode", "decode", *extra)


def launch_servers(model: str, flag_sets: list[tuple[str, ...]], env: dict | None = None,
                   timeout_s: float = 180, log_dir: str | None = None, envs: list[dict] | None = None) -> list:
    """One server per flag set, started in parallel (logs in ``log_dir``); all stopped again if
    any fails. ``envs``: per server, added to ``env``."""
    envs = envs or [{}] * len(flag_sets)
    with ThreadPoolExecutor(len(flag_sets)) as pool:
        futures = [pool.submit(launch_server_process, model, *BASE_FLAGS, *flags, timeout_s=timeout_s,
                               env={**(env or {}), **extra}, log_dir=log_dir)
                   for flags, extra in zip(flag_sets, envs, strict=True)]
    servers, errors = [], []
    for fut in futures:
        try:
            servers.append(fut.result())
        except Exception as exc:  # noqa: BLE001 - reported below after cleanup
            errors.append(exc)
    if errors:
        for srv in servers:
            srv.stop()
        raise errors[0]
    return servers


def scheduler_info(server) -> dict:
    return server.get("/get_server_info").json()["scheduler"]


def wait_settled(server, timeout: float = 30) -> dict:
    """Scheduler stats once nothing is queued, running or in transfer. The scheduler runs its
    idle integrity check in the loop iteration that empties it, before it answers the stats
    request, and a failed check kills it (``/health`` then answers 503)."""
    deadline = time.monotonic() + timeout
    while True:
        info = scheduler_info(server)
        pd = info.get("disaggregation", {})
        busy = info["num_running_reqs"] + info["num_waiting_reqs"] + pd.get("pd_active_rooms", 0) + sum(
            v for k, v in pd.items() if k.endswith("_queue"))
        if busy == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def scheduler_pids(server) -> list[int]:
    """The scheduler processes of a server (spawned children of its launcher)."""
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return [p.pid for p in procs if "multiprocessing.spawn" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_server(server) -> None:
    """SIGKILL the server's whole process group at once (no graceful shutdown)."""
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait(10)


def generate_ids(url: str, input_ids: list[int], max_new: int, stream: bool = False, timeout: float = 120) -> list[int]:
    body = {"input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    resp = requests.post(url + "/generate", json=body, timeout=timeout, stream=stream)
    assert resp.status_code == 200, resp.text[:500]
    if not stream:
        try:
            return resp.json()["output_ids"]
        except (ValueError, KeyError) as exc:
            raise AssertionError(f"{url}/generate answered 200 with {resp.text[:500]!r} "
                                 f"(headers {dict(resp.headers)})") from exc
    events = [json.loads(line[6:]) for line in (raw.decode("utf-8") for raw in resp.iter_lines())
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events[-1]["output_ids"]


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def _multi_turn(url: str, ref_url: str, prompts: list[list[int]]) -> None:
    convs = [list(p) for p in prompts]
    for turn in range(3):
        for c, history in enumerate(convs):
            want = generate_ids(ref_url, history, 10)
            got = generate_ids(url, history, 10, stream=turn == 2)
            assert got == want, f"conversation {c} turn {turn}"
            convs[c] = history + want + [(11 * turn + c + i) % 700 + 3 for i in range(7)]


def check_pd_pair(model: str, ref_url: str | None, prefill_tp: int, decode_tp: int, prompts: list[list[int]],
                  log_dir: str | None = None, flags: tuple[str, ...] = (),
                  reference_flags: tuple[str, ...] = ()) -> None:
    """Prefill (tp ``prefill_tp``) + decode (tp ``decode_tp``) + the PD router: single prompts and
    a 3-turn workload token-identical to the server at ``ref_url``; both PD servers settle with no
    failure, no open room and a passed idle integrity check. ``flags``: added to both servers.
    ``ref_url`` None: a plain tp1 server with ``reference_flags`` starts beside the pair (in
    parallel, stopped with it) and is the reference."""
    (bootstrap_port,) = free_ports(1)
    backend = dict(zip(flags, flags[1:])).get("--disaggregation-transfer-backend", "nixl")
    flag_sets = [prefill_flags(bootstrap_port, "--tp-size", str(prefill_tp), *flags),
                 decode_flags("--tp-size", str(decode_tp), *flags)] + ([reference_flags] if ref_url is None else [])
    prefill, decode, *own_ref = launch_servers(model, flag_sets, log_dir=log_dir)
    ref_url = own_ref[0].url if own_ref else ref_url
    router = None
    try:
        router = launch_pd_router([(prefill.url, bootstrap_port)], [decode.url], log_dir=log_dir)
        for i, prompt in enumerate(prompts):
            got, want = generate_ids(router.url, prompt, 16), generate_ids(ref_url, prompt, 16)
            assert got == want, f"prompt {i}: PD {got} vs reference {want}"
        _multi_turn(router.url, ref_url, prompts)
        for srv in (prefill, decode):
            info = wait_settled(srv)
            pd = info["disaggregation"]
            assert pd["pd_failed"] == 0 and pd["pd_active_rooms"] == 0 and pd["pd_transferred"] >= 4 * len(prompts), pd
            assert pd["pd_transfer_backend"] == backend, pd
            assert info["counters"]["num_idle_checks"] > 0
            assert srv.get("/health").status_code == 200
    finally:
        for proc in (router, prefill, decode, *own_ref):
            if proc is not None:
                proc.stop()


@contextlib.contextmanager
def reference_server(model: str, log_dir: str):
    """A plain (non-PD) tp1 server of ``model``: the token reference of the PD pair tests."""
    (srv,) = launch_servers(model, [()], log_dir=log_dir)
    try:
        yield srv
    finally:
        srv.stop()
