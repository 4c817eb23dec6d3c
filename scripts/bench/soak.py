"""Soak: N minutes of mixed greedy traffic against a real deployment on 127.0.0.1, with faults.

Starts (free ports, 127.0.0.1 only) a tiny qwen3 checkpoint served by
- a plain server (no HiCache): the reference, computed once up front, then stopped;
- a HiCache server with a file L3 directory, behind ``sglang-router`` (regular mode);
- a PD pair (prefill + decode) behind ``sglang-router --pd-disaggregation``.

Traffic (``--workers`` threads, each request with ``--request-timeout``): multi-turn conversations
(each turn's prompt is the history built from the reference answers, so a correct server sees
exactly the reference's prompts), streamed and non-streamed, client aborts (the stream is closed
after a few chunks), long prompts. Every output, completed or partial, must be the reference's
tokens (or a prefix of them for an abort or a failure).

Faults, every ``--fault-gap-s`` from ``--first-fault-s`` in this order, cycling: the L3 directory
made read-only (chmod, plus ``chattr +i`` when root), made writable again, its files truncated /
overwritten with garbage, removed and recreated, the decode server SIGKILLed (by pid, launcher
and schedulers) and restarted on its port.

At the end of every window (``--window-minutes``) traffic pauses, the servers settle, and one line
is printed: requests ok / failed / aborted, mismatches, leaked device slots at idle (used - cached
with nothing running), idle checks run, scheduler RSS, p50 / p99 TTFT and ITL of streamed requests.
The HiCache server's device and host tiers are then flushed, so the next window reads L3.

    python scripts/bench/soak.py --minutes 30 [--window-minutes 5] [--workers 4]

Failed requests are counted, not fatal: during a fault they are expected. With one decode server
and sglang-router's default flags, the router opens the prefill's circuit breaker while the
decode server is down and keeps answering 503 ("No available prefill workers") for about a minute
after the decode server is back; the window lines show it as PD failures.

Exit status 1 on a wrong output, a leaked slot or a crash (a server, scheduler or router process
that died unplanned); 130 on Ctrl-C. Everything started is stopped by pid on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import psutil  # noqa: E402
import requests  # noqa: E402

from sglang.test.multiprocess import free_port  # noqa: E402
from sglang.test.router_utils import launch_pd_router, launch_router  # noqa: E402
from sglang.test.server_utils import TEST_ADMIN_API_KEY, launch_server_process, start_process  # noqa: E402

COMMON = ["--context-length", "2048", "--served-model-name", "tiny"]
GREEDY = {"temperature": 0, "ignore_eos": True}
FAULTS = ["l3_read_only", "l3_writable", "l3_corrupt", "l3_remove_recreate", "decode_kill_restart"]


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Prompt:
    ids: list[int]
    want: list[int]  # the reference's greedy tokens
    conversation: int  # -1: a long single-turn prompt


def build_workload(ref, args, rng: random.Random) -> list[list[Prompt]]:
    """Conversations of ``--turns`` turns (a shared system prompt, then each turn the history plus
    a new question) and single-turn long prompts; answered once by the reference server ``ref``."""
    system = [rng.randrange(3, 999) for _ in range(64)]

    def answer(ids: list[int]) -> list[int]:
        out = ref.generate(input_ids=ids, sampling_params={"max_new_tokens": args.max_new, **GREEDY}, timeout=300)
        return out["output_ids"]

    convs = []
    for c in range(args.conversations):
        history, turns = list(system), []
        for _ in range(args.turns):
            ids = history + [rng.randrange(3, 999) for _ in range(48)]
            turns.append(Prompt(ids, answer(ids), c))
            history = ids + turns[-1].want
        convs.append(turns)
    longs = [[Prompt(ids, answer(ids), -1)] for ids in
             ([rng.randrange(3, 999) for _ in range(args.long_len)] for _ in range(args.long_prompts))]
    return convs + longs


@dataclass
class Result:
    target: str
    kind: str  # stream, plain, abort, long
    tokens: list[int]
    want: list[int]
    error: str | None = None
    aborted: bool = False
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.aborted

    @property
    def wrong(self) -> bool:
        """A completed output unlike the reference, or partial tokens that are not its prefix."""
        if self.ok:
            return self.tokens != self.want
        return self.tokens != self.want[:len(self.tokens)]


def send(url: str, prompt: Prompt, max_new: int, stream: bool, abort_after: int, timeout: float) -> Result:
    """One /generate; streamed results carry TTFT and per-token ITL. Never raises."""
    kind = "abort" if abort_after else "long" if prompt.conversation < 0 else "stream" if stream else "plain"
    res = Result("", kind, [], prompt.want)
    body = {"input_ids": prompt.ids, "stream": stream, "sampling_params": {"max_new_tokens": max_new, **GREEDY}}
    t0 = last = time.monotonic()
    try:
        with requests.post(url + "/generate", json=body, timeout=timeout, stream=stream) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}"
                return res
            if not stream:
                res.tokens = resp.json()["output_ids"]
                return res
            chunks = 0
            for line in resp.iter_lines():
                if time.monotonic() - t0 > timeout:
                    res.error = "timeout"
                    return res
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = f"stream error {event['error'].get('code')}"
                    return res
                now, new = time.monotonic(), len(event["output_ids"]) - len(res.tokens)
                if new > 0:
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    else:
                        res.itls_s += [(now - last) / new] * new
                    last = now
                res.tokens, chunks = event["output_ids"], chunks + 1
                if abort_after and chunks >= abort_after and len(res.tokens) < max_new:
                    res.aborted = True  # leaving the with-block closes the connection mid-stream
                    return res
            if len(res.tokens) != max_new:
                res.error = f"stream ended after {len(res.tokens)} tokens"
    except (requests.RequestException, ValueError, KeyError) as exc:
        res.error = type(exc).__name__
    return res


class Traffic:
    """``workers`` threads walking conversations turn by turn against the targets, pausable."""

    def __init__(self, targets: dict[str, str], workload: list[list[Prompt]], args):
        self.targets, self.workload, self.args = targets, workload, args
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self.running = threading.Event()  # set: send requests
        self.stop = threading.Event()
        self.busy = [False] * args.workers
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(args.workers)]

    def _worker(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        names = sorted(self.targets)
        while not self.stop.is_set():
            if not self.running.wait(0.2):
                continue
            conv = rng.choice(self.workload)
            target = names[rng.randrange(len(names))]
            for prompt in conv:
                if not self.running.is_set() or self.stop.is_set():
                    break
                self.busy[i] = True
                r = rng.random()
                abort_after = rng.randint(1, 3) if r < self.args.abort_fraction else 0
                res = send(self.targets[target], prompt, self.args.max_new, stream=r < 0.6 or bool(abort_after),
                           abort_after=abort_after, timeout=self.args.request_timeout)
                res.target = target
                with self.lock:
                    self.results.append(res)
                self.busy[i] = False
                if res.error is not None:
                    time.sleep(0.2)  # a fault is on: do not spin on a dead target
                    break

    def start(self) -> None:
        self.running.set()
        for t in self.threads:
            t.start()

    def pause(self, timeout: float) -> bool:
        """Stop sending and wait (at most ``timeout`` s) until no request is in flight."""
        self.running.clear()
        deadline = time.monotonic() + timeout
        while any(self.busy) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not any(self.busy)

    def take(self) -> list[Result]:
        with self.lock:
            out, self.results = self.results, []
        return out

    def close(self) -> None:
        self.stop.set()
        self.running.clear()
        for t in self.threads:
            t.join(self.args.request_timeout + 5)


# ---- deployment --------------------------------------------------------------------------------
def scheduler_pids(server) -> list[int]:
    """The scheduler processes of a server: its spawned children."""
    try:
        procs = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            pids.append(p.pid)
    return pids


def rss_mib(pids: list[int]) -> float:
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total_kb += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total_kb / 1024


def launch_on_port(model: str, port: int, flags: list[str], log_dir: str):
    """launch_server_process on a given port (a restarted decode server keeps its router entry)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), *flags,
           "--admin-api-key", TEST_ADMIN_API_KEY]

    def healthy(url: str) -> bool:
        try:
            return requests.get(url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    server = start_process(cmd, port, healthy, "decode", 300, log_dir=log_dir)
    server.admin_headers = {"Authorization": f"Bearer {TEST_ADMIN_API_KEY}"}
    return server


class Deployment:
    """The servers and routers; ``check_alive`` reports any process that died unplanned."""

    def __init__(self, model: str, tmp: str, log_dir: str):
        self.model, self.log_dir = model, log_dir
        self.l3_dir = os.path.join(tmp, "l3")
        os.makedirs(log_dir, exist_ok=True)
        os.makedirs(self.l3_dir, mode=0o700)
        self.servers: dict = {}
        self.routers: dict = {}
        self.sched_pids: dict[str, list[int]] = {}
        self.decode_down = threading.Event()  # set while the decode server is killed on purpose
        self.bootstrap_port = free_port()
        self.decode_port = free_port()
        self.decode_flags = [*COMMON, "--max-total-tokens", "4096", "--disaggregation-mode", "decode"]

    def start(self) -> None:
        hicache = [*COMMON, "--page-size", "4", "--max-total-tokens", "1536", "--enable-hierarchical-cache",
                   "--hicache-ratio", "2", "--hicache-storage-backend", "file",
                   "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend-extra-config",
                   json.dumps({"storage_dir": self.l3_dir, "prefetch_threshold": 4})]
        prefill = [*COMMON, "--max-total-tokens", "4096", "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        with ThreadPoolExecutor(2) as pool:
            futures = {"hicache": pool.submit(launch_server_process, self.model, *hicache, timeout_s=300,
                                              log_dir=self.log_dir),
                       "prefill": pool.submit(launch_server_process, self.model, *prefill, timeout_s=300,
                                              log_dir=self.log_dir),
                       "decode": pool.submit(launch_on_port, self.model, self.decode_port, self.decode_flags,
                                             self.log_dir)}
            for name, fut in futures.items():
                try:
                    self.servers[name] = fut.result()
                except Exception as exc:  # noqa: BLE001 - the others still have to be stopped
                    print(f"{name} failed to start: {exc}", file=sys.stderr)
        if len(self.servers) != len(futures):
            raise RuntimeError("a server failed to start")
        self.routers["hicache"] = launch_router([self.servers["hicache"].url], "cache_aware", timeout_s=120)
        self.routers["pd"] = launch_pd_router([(self.servers["prefill"].url, self.bootstrap_port)],
                                              [self.servers["decode"].url], timeout_s=120, log_dir=self.log_dir)
        self.sched_pids = {name: scheduler_pids(s) for name, s in self.servers.items()}

    def check_alive(self) -> list[str]:
        dead = []
        for name, proc in [*self.servers.items(), *(("router-" + n, r) for n, r in self.routers.items())]:
            if name == "decode" and self.decode_down.is_set():
                continue
            if proc.proc.poll() is not None:
                dead.append(f"{name} exited {proc.proc.returncode}")
            for pid in self.sched_pids.get(name, []):
                if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    dead.append(f"{name} scheduler {pid} gone")
        return dead

    def kill_restart_decode(self) -> float:
        """SIGKILL the decode server's launcher and schedulers by pid, restart it on its port;
        returns the seconds it was down."""
        old = self.servers["decode"]
        self.decode_down.set()
        t0 = time.monotonic()
        for pid in [old.proc.pid, *self.sched_pids["decode"]]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        old.proc.wait(10)
        old.stop()  # anything else left in its group
        new = launch_on_port(self.model, self.decode_port, self.decode_flags, self.log_dir)
        self.servers["decode"], self.sched_pids["decode"] = new, scheduler_pids(new)
        self.decode_down.clear()
        return time.monotonic() - t0

    def stop(self) -> None:
        for proc in [*self.routers.values(), *self.servers.values()]:
            proc.stop()


# ---- faults ------------------------------------------------------------------------------------
def set_read_only(path: str, read_only: bool) -> None:
    """chmod the tree; as root chmod does not stop writes, so also ``chattr +i`` (immutable)."""
    if os.geteuid() == 0 and shutil.which("chattr") and not read_only:
        subprocess.run(["chattr", "-R", "-i", path], capture_output=True, timeout=30)
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o500 if read_only else 0o700)
    if os.geteuid() == 0 and shutil.which("chattr") and read_only:
        subprocess.run(["chattr", "-R", "+i", path], capture_output=True, timeout=30)


def corrupt_files(path: str, rng: random.Random) -> int:
    """Truncate half the files and overwrite the others' middles with garbage; returns files hit."""
    hit = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            try:
                size = os.path.getsize(full)
                with open(full, "r+b") as f:
                    if rng.random() < 0.5:
                        f.truncate(size // 2)
                    else:
                        f.seek(size // 2)
                        f.write(os.urandom(min(64, max(1, size - size // 2))))
                hit += 1
            except OSError:
                pass
    return hit


def run_faults(dep: Deployment, args, stop: threading.Event, log: list[str], t_start: float) -> None:
    rng = random.Random(args.seed)
    at, i = args.first_fault_s, 0
    end = t_start + args.minutes * 60
    while t_start + at < end - 1 and not stop.is_set():
        if stop.wait(max(0.0, t_start + at - time.monotonic())):
            return
        name = args.faults[i % len(args.faults)]
        try:
            if name in ("l3_read_only", "l3_writable"):
                set_read_only(dep.l3_dir, name == "l3_read_only")
                detail = ""
            elif name == "l3_corrupt":
                detail = f" ({corrupt_files(dep.l3_dir, rng)} files)"
            elif name == "l3_remove_recreate":
                gone = f"{dep.l3_dir}.removed-{i}"
                os.rename(dep.l3_dir, gone)  # atomic; the server may be writing into it right now
                os.makedirs(dep.l3_dir, mode=0o700)
                shutil.rmtree(gone, ignore_errors=True)
                detail = ""
            else:
                detail = f" (down {dep.kill_restart_decode():.1f} s)"
        except Exception as exc:  # noqa: BLE001 - reported in the summary, the soak goes on
            detail = f" FAILED: {type(exc).__name__}: {exc}"
            if name == "decode_kill_restart":
                log.append(f"{time.monotonic() - t_start:7.1f}s {name}{detail}")
                return  # no decode server any more: later windows count PD failures
        log.append(f"{time.monotonic() - t_start:7.1f}s {name}{detail}")
        print(f"  fault at {time.monotonic() - t_start:.0f}s: {name}{detail}", flush=True)
        # a slow fault (a restart) delays the next ones rather than bunching them up
        at, i = max(at + args.fault_gap_s, time.monotonic() - t_start + args.fault_gap_s / 2), i + 1
    if i and args.faults[(i - 1) % len(args.faults)] == "l3_read_only":
        set_read_only(dep.l3_dir, False)


# ---- windows -----------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def settle(server, timeout: float) -> dict | None:
    """The scheduler snapshot once nothing is running, waiting or in a PD room; None if never."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = server.get("/get_server_info", timeout=10).json()["scheduler"]
        except (requests.RequestException, ValueError, KeyError):
            time.sleep(0.5)
            continue
        pd = info.get("disaggregation", {})
        busy = info["num_running_reqs"] + info["num_waiting_reqs"] + pd.get("pd_active_rooms", 0)
        if busy == 0:
            return info
        time.sleep(0.2)
    return None


def window_report(w: int, results: list[Result], dep: Deployment, idle_checks: dict, args) -> tuple[str, list[str]]:
    problems = []
    ok = sum(r.ok for r in results)
    failed = sum(r.error is not None for r in results)
    aborted = sum(r.aborted for r in results)
    wrong = [r for r in results if r.wrong]
    wrong_done = sum(r.ok for r in wrong)
    for r in wrong[:3]:
        problems.append(f"window {w}: {r.target} {r.kind} wrong output {r.tokens[:12]} != {r.want[:12]}")
    if wrong:
        problems.append(f"window {w}: {len(wrong)} wrong outputs ({wrong_done} completed)")
    leaks, checks, rss = [], [], []
    for name, srv in dep.servers.items():
        info = settle(srv, args.settle_timeout)
        if info is None:
            leaks.append(f"{name}=?")
            problems.append(f"window {w}: {name} did not settle within {args.settle_timeout} s")
            continue
        device = info["pools"]["device"]
        leaked = device["used_tokens"] - device["cached_tokens"]
        leaks.append(f"{name}={leaked}")
        if leaked:
            problems.append(f"window {w}: {name} holds {leaked} device slots at idle")
        n = info["counters"]["num_idle_checks"]
        checks.append(f"{name}={n}")
        idle_checks[name] = n
        rss.append(f"{name}={rss_mib(dep.sched_pids[name]):.0f}")
    ttft = [r.ttft_s * 1e3 for r in results if r.ttft_s is not None]
    itl = [x * 1e3 for r in results for x in r.itls_s]
    errors = Counter(f"{r.target}:{r.error}" for r in results if r.error is not None).most_common(3)
    by_target = " ".join(f"{t}:{sum(r.ok for r in results if r.target == t)}/"
                         f"{sum(r.error is not None for r in results if r.target == t)}"
                         for t in sorted(dep.routers))
    line = (f"window {w}: ok {ok} failed {failed} aborted {aborted} ({by_target}) | mismatches {len(wrong)} "
            f"(completed {wrong_done}) | leaked slots {' '.join(leaks)} | idle checks {' '.join(checks)} | "
            f"scheduler RSS MiB {' '.join(rss)} | TTFT p50 {pct(ttft, 50):.0f} p99 {pct(ttft, 99):.0f} ms | "
            f"ITL p50 {pct(itl, 50):.1f} p99 {pct(itl, 99):.1f} ms"
            + (f" | errors {', '.join(f'{e} x{n}' for e, n in errors)}" if errors else ""))
    return line, problems


def soak(dep: Deployment, traffic: Traffic, args) -> list[str]:
    problems, fault_log, idle_checks = [], [], {}
    stop_faults = threading.Event()
    t_start = time.monotonic()
    faults = threading.Thread(target=run_faults, args=(dep, args, stop_faults, fault_log, t_start), daemon=True)
    faults.start()
    traffic.start()
    end = t_start + args.minutes * 60
    w, last_ok = 0, None
    try:
        while time.monotonic() < end - 0.5 and not problems:
            w += 1
            w_end = min(end, time.monotonic() + args.window_minutes * 60)
            while time.monotonic() < w_end:
                time.sleep(min(1.0, max(0.0, w_end - time.monotonic())))
                dead = dep.check_alive()
                if dead:
                    problems.append(f"window {w}: crash: {', '.join(dead)}")
                    break
            if not traffic.pause(args.request_timeout + 5):
                problems.append(f"window {w}: requests still in flight {args.request_timeout + 5} s after the pause")
            while dep.decode_down.is_set() and time.monotonic() < w_end + 320:
                time.sleep(0.5)  # a restart in progress: measure the new decode server once it is up
            results = traffic.take()
            last_ok = {t: sum(r.ok for r in results if r.target == t) for t in dep.routers}
            line, found = window_report(w, results, dep, idle_checks, args)
            print(line, flush=True)
            problems += found + [f"window {w}: crash: {d}" for d in dep.check_alive()]
            try:
                dep.servers["hicache"].post("/flush_cache", timeout=30)  # next window reads L3
            except requests.RequestException:
                pass
            traffic.running.set()
    finally:
        stop_faults.set()
        traffic.close()
        faults.join(330)
    print("faults: " + ("; ".join(s.strip() for s in fault_log) or "none"), flush=True)
    if last_ok is not None:
        idle_targets = [t for t, n in last_ok.items() if n == 0]
        if idle_targets:
            print(f"note: no request succeeded through {', '.join(idle_targets)} in the last window", flush=True)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--window-minutes", type=float, default=5.0)
    ap.add_argument("--model-path", help="HF-format model directory (default: a tiny random qwen3)")
    ap.add_argument("--workers", type=int, default=4, help="concurrent client threads")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=1200, help="tokens of a long prompt")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--abort-fraction", type=float, default=0.15)
    ap.add_argument("--request-timeout", type=float, default=90.0, help="seconds per request")
    ap.add_argument("--settle-timeout", type=float, default=60.0, help="seconds for a server to go idle")
    ap.add_argument("--first-fault-s", type=float, default=60.0)
    ap.add_argument("--fault-gap-s", type=float, default=60.0)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated cycle of: {', '.join(FAULTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", help="keep the server and router logs here (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.window_minutes <= 0:
        ap.error("--minutes and --window-minutes must be > 0")
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown:
        ap.error(f"--faults: unknown {unknown}; allowed: {', '.join(FAULTS)}")

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # SIGTERM too: stop everything started, then exit

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        dep = None
        try:
            model = args.model_path
            if model is None:
                from sglang.test.engine_utils import make_tiny_model

                model = make_tiny_model(os.path.join(tmp, "tiny"), "qwen3")
            t0 = time.monotonic()
            with launch_server_process(model, *COMMON, "--max-total-tokens", "16384", timeout_s=300,
                                       log_dir=tmp) as ref:
                workload = build_workload(ref, args, random.Random(args.seed))
            print(f"reference: {sum(len(c) for c in workload)} prompts in {time.monotonic() - t0:.0f} s", flush=True)
            dep = Deployment(model, tmp, args.log_dir or tmp)
            dep.start()
            print(f"deployment up: hicache {dep.servers['hicache'].url} (router {dep.routers['hicache'].url}), "
                  f"prefill {dep.servers['prefill'].url}, decode {dep.servers['decode'].url} "
                  f"(router {dep.routers['pd'].url}); L3 {dep.l3_dir}", flush=True)
            traffic = Traffic({n: r.url for n, r in dep.routers.items()}, workload, args)
            problems = soak(dep, traffic, args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            if dep is not None:
                if os.path.isdir(dep.l3_dir):
                    set_read_only(dep.l3_dir, False)  # or the temp directory cannot be removed
                dep.stop()
    for p in problems:
        print("FAIL " + p)
    print("soak " + ("FAILED" if problems else "passed: 0 wrong outputs, 0 leaked slots, 0 crashes"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
