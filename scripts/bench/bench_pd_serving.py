"""PD serving vs a single server of the same total TP, on the same workload, plus the transfer
benchmark's ratio to raw NIXL.

Starts (on 127.0.0.1, free ports) a plain server with ``--tp-size PREFILL_TP + DECODE_TP``, a
prefill server (``--tp-size PREFILL_TP``) and a decode server (``--tp-size DECODE_TP``) behind
the real ``sglang-router --pd-disaggregation``; runs ``sglang.bench_serving`` (native streaming
``/generate``, random prompts, the same seed) against the single server and against the router,
one after the other; prints TTFT / ITL / E2E and throughput of both and the PD / single ratios
(> 1 means PD is slower for latencies, faster for throughput). Then runs
``bench_pd_transfer.py`` on the same TP pair (and the homogeneous pair of the prefill TP) and
prints its PD-transfer / raw-NIXL ratios (targets: >= 0.8 homogeneous, heterogeneous >= 0.8 of
homogeneous).

    python scripts/bench/bench_pd_serving.py [--model-path DIR | --tiny] [--prefill-tp 1] [--decode-tp 1]
        [--num-prompts 64] [--input-len 512] [--output-len 64] [--max-concurrency 8] [--json out.json]

On CPU the servers run with one OpenMP thread each (``server_env``), like the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from sglang.test.multiprocess import free_port  # noqa: E402
from sglang.test.router_utils import launch_pd_router  # noqa: E402
from sglang.test.server_utils import launch_server_process  # noqa: E402

METRICS = [  # (record key, label, higher is better)
    ("mean_ttft_ms", "mean TTFT (ms)", False),
    ("median_ttft_ms", "median TTFT (ms)", False),
    ("p99_ttft_ms", "p99 TTFT (ms)", False),
    ("mean_itl_ms", "mean ITL (ms)", False),
    ("median_itl_ms", "median ITL (ms)", False),
    ("mean_e2e_latency_ms", "mean E2E (ms)", False),
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tok/s", True),
]


def bench(url: str, args, model_path: str) -> dict:
    from sglang.bench_serving import parse_args, run_benchmark

    flags = ["--backend", "sglang", "--base-url", url, "--model", args.served_name, "--tokenizer", model_path,
             "--dataset-name", "random", "--num-prompts", str(args.num_prompts), "--random-input-len",
             str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
             "--max-concurrency", str(args.max_concurrency), "--request-rate", str(args.request_rate),
             "--seed", str(args.seed), "--warmup-requests", "2", "--disable-tqdm"]
    return run_benchmark(parse_args(flags))


def transfer_ratios(args) -> list[dict]:
    tp, td, heads = args.prefill_tp, args.decode_tp, args.kv_heads
    cases = {f"{tp}x{tp}x{heads}", f"{tp}x{td}x{heads}"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "transfer.json"
        cmd = [sys.executable, str(ROOT / "scripts/bench/bench_pd_transfer.py"), "--cases", ",".join(sorted(cases)),
               "--tokens", str(args.transfer_tokens), "--iters", str(args.transfer_iters), "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_pd_transfer.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="HF-format model directory")
    src.add_argument("--tiny", action="store_true", help="make and use a tiny random qwen3 model")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--single-tp", type=int, default=None, help="TP of the single server (default: prefill + decode)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once, within max-concurrency)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--server-flags", default="--context-length 4096 --max-total-tokens 32768",
                    help="extra flags for every server (one string)")
    ap.add_argument("--served-name", default="bench")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of the transfer benchmark's pools")
    ap.add_argument("--transfer-tokens", type=int, default=4096)
    ap.add_argument("--transfer-iters", type=int, default=5)
    ap.add_argument("--skip-transfer", action="store_true", help="serving comparison only")
    ap.add_argument("--json", help="write the records (single, pd, ratios, transfer) to this file")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path
        if args.tiny:
            from sglang.test.engine_utils import make_tiny_model

            model = make_tiny_model(str(Path(tmp) / "tiny"), "qwen3")
        common = [*args.server_flags.split(), "--served-model-name", args.served_name]
        single_tp = args.single_tp or args.prefill_tp + args.decode_tp
        bootstrap_port = free_port()
        flag_sets = [
            [*common, "--tp-size", str(single_tp)],
            [*common, "--tp-size", str(args.prefill_tp), "--disaggregation-mode", "prefill",
             "--disaggregation-bootstrap-port", str(bootstrap_port)],
            [*common, "--tp-size", str(args.decode_tp), "--disaggregation-mode", "decode"],
        ]
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(launch_server_process, model, *f, timeout_s=600, log_dir=tmp) for f in flag_sets]
        servers = [f.result() for f in futures]
        router = None
        try:
            router = launch_pd_router([(servers[1].url, bootstrap_port)], [servers[2].url], log_dir=tmp)
            single = bench(servers[0].url, args, model)
            pd = bench(router.url, args, model)
        finally:
            for proc in (router, *servers):
                if proc is not None:
                    proc.stop()

    single_tp = args.single_tp or args.prefill_tp + args.decode_tp
    print(f"\nPD (prefill tp {args.prefill_tp} + decode tp {args.decode_tp}) vs single server tp {single_tp}: "
          f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, concurrency "
          f"{args.max_concurrency}")
    print(f"{'metric':<20}{'single':>12}{'PD':>12}{'PD/single':>12}")
    ratios = {}
    for key, label, _ in METRICS:
        a, b = single.get(key), pd.get(key)
        if a is None or b is None:
            continue
        ratios[key] = b / a if a else float("nan")
        print(f"{label:<20}{a:>12.2f}{b:>12.2f}{ratios[key]:>12.2f}")
    print(f"failed requests: single {single['failed']}, PD {pd['failed']}")

    transfer = []
    if not args.skip_transfer:
        transfer = transfer_ratios(args)
        print("\nKV transfer vs raw NIXL of the same bytes (bench_pd_transfer.py):")
        for r in transfer:
            extra = f", {r['vs_homogeneous']:.2f}x of homogeneous" if "vs_homogeneous" in r else ""
            print(f"  TP {r['prefill_tp']}->{r['decode_tp']} H={r['kv_heads']}: {r['gbps']:.2f} GB/s, "
                  f"{r['ratio']:.2f}x raw NIXL{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": single, "pd": pd, "ratios": ratios, "transfer": transfer},
                                              indent=2, default=str))
    return 0 if single["failed"] == 0 and pd["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
