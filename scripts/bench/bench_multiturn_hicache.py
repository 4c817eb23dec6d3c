"""HiCache off vs on for the multi-turn benchmark, in one go.

    OMP_NUM_THREADS=1 python scripts/bench/bench_multiturn_hicache.py --json out.json
    python scripts/bench/bench_multiturn_hicache.py --model-path DIR --device-tokens 4096 ...
    # issue 9's closed-loop case: 8 conversations x 4 rounds, each round's requests at once
    python scripts/bench/bench_multiturn_hicache.py --model-path DIR --device-tokens 1100 \\
        --num-clients 8 --num-rounds 4 --system-prompt-length 600 --request-length 80 \\
        --output-length 24 --round-barrier --repeat 3 [--noisy-neighbours 4]

Starts a server with a device pool of ``--device-tokens`` (smaller than the conversations'
working set) and the plain radix cache, runs bench_multiturn.py against it, stops it, then does
the same with ``--enable-hierarchical-cache`` (host pool ``--hicache-ratio`` times the device
pool, plus every ``--hicache-flag``), and prints both reports and the ratios. With ``--repeat K``
the off / on pair runs K times, interleaved (off, on, off, on, ...), and the ratios are medians:
on a shared host that is what makes them comparable. ``--noisy-neighbours N`` runs N neighbour
processes beside the server during every run. Without ``--model-path`` it builds a model where
prefill dominates (make_tiny_model --hidden 512 --layers 8, as in docs/engine.md) of architecture
``--arch``: ``qwen3`` (MHA, the default) or ``qwen3_next`` (Gated DeltaNet + attention: the state
model, whose prefixes hit where its state checkpoints are).

The sequential multi-turn case (a long first prompt, short follow-ups, a rate the off server
keeps up with; issue 28's figures in docs/hicache_design.md):

    OMP_NUM_THREADS=1 python scripts/bench/bench_multiturn_hicache.py --arch qwen3_next \
        --request-rate 0.35 --request-length 1024 --sub-question-input-length 128 --num-rounds 6 \
        --output-length 16 --device-tokens 4096 --repeat 2

``--ideal-device-tokens N`` adds a third server per repeat, the plain cache with a device pool of N
tokens that holds every conversation: its TTFT is the floor any cache tier can reach on this
workload, so ``on_vs_ideal_ttft`` is the cost of HiCache and ``ideal_ttft_ratio`` the workload's
best on/off ratio.

``--json`` writes ttft_p50_off, ttft_p50_on, ttft_ratio (on / off, TTFT p50), ttft_p90_ratio,
wall_ratio (on / off, wall time of a run), throughput_ratio (on / off, prompt + answer tokens per
second), hit_rate (on), reusable_fraction, outputs_identical (every answer the same on and off),
the per-repeat ratios, and the first pair's full reports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

from bench_multiturn import add_workload_args, bench, print_report  # noqa: E402

from sglang.test.engine_utils import make_tiny_model  # noqa: E402
from sglang.test.server_utils import launch_server_process  # noqa: E402

PREFILL_MODEL = ["--hidden", "512", "--layers", "8", "--heads", "8", "--kv-heads", "4", "--intermediate", "1536",
                 "--vocab", "4000", "--max-pos", "8192"]
ARCHS = ("qwen3", "qwen3_next")  # MHA; Gated DeltaNet + attention (state checkpoints)


def run_server(model: str, flags: list[str], args) -> dict:
    with launch_server_process(model, *flags, timeout_s=600) as srv:
        print(f"server {' '.join(flags)}", flush=True)
        args.admin_api_key = srv.admin_headers["Authorization"].removeprefix("Bearer ")  # bench flushes first
        return bench(srv.url, args)


def tput(s: dict) -> float:
    return s["input_throughput"] + s["output_throughput"]


def ratios(off: dict, on: dict) -> dict:
    return {"ttft_ratio": on["ttft_p50"] / off["ttft_p50"], "ttft_p90_ratio": on["ttft_p90"] / off["ttft_p90"],
            "wall_ratio": on["wall_s"] / off["wall_s"], "throughput_ratio": tput(on) / tput(off),
            "outputs_identical": on["outputs"] == off["outputs"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="default: a prefill-dominated model built into a temp dir")
    parser.add_argument("--arch", choices=ARCHS,
                        help="architecture of the built model (default qwen3; not with --model-path)")
    parser.add_argument("--device-tokens", type=int, default=4096, help="device KV pool of both servers")
    parser.add_argument("--hicache-ratio", type=float, default=8.0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for both servers")
    parser.add_argument("--hicache-flag", action="append", default=[], help="extra flag for the HiCache server")
    parser.add_argument("--repeat", type=int, default=1, help="off/on pairs, interleaved; ratios are medians")
    parser.add_argument("--ideal-device-tokens", type=int, default=0,
                        help="also run, once per repeat, a plain radix-cache server whose device pool has this "
                             "many tokens (enough for every conversation): the TTFT no cache tier can beat")
    parser.add_argument("--json", help="write the ratios and reports to this file")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.model_path and args.arch:
        parser.error("--arch picks the built model; with --model-path the checkpoint's config decides")
    tmp = tempfile.TemporaryDirectory(prefix="bench-multiturn-")
    model = args.model_path or make_tiny_model(os.path.join(tmp.name, "model"), args.arch or "qwen3",
                                                       *PREFILL_MODEL)
    def plain(device_tokens: int) -> list[str]:
        return ["--max-total-tokens", str(device_tokens), "--page-size", str(args.page_size), *args.server_flag]

    common = plain(args.device_tokens)
    hicache = [*common, "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio), *args.hicache_flag]
    pairs = []
    for i in range(args.repeat):
        off = run_server(model, common, args)
        print_report(f"HiCache off (run {i + 1}/{args.repeat})", off)
        on = run_server(model, hicache, args)
        print_report(f"HiCache on (run {i + 1}/{args.repeat})", on)
        pairs.append((off, on, ratios(off, on)))
        r = pairs[-1][2]
        if args.ideal_device_tokens:
            ideal = run_server(model, plain(args.ideal_device_tokens), args)
            print_report(f"plain cache, device pool {args.ideal_device_tokens} (run {i + 1}/{args.repeat})", ideal)
            r["ttft_p50_ideal"] = ideal["ttft_p50"]
            r["on_vs_ideal_ttft"] = on["ttft_p50"] / ideal["ttft_p50"]
            r["ideal_ttft_ratio"] = ideal["ttft_p50"] / off["ttft_p50"]
            print(f"-- run {i + 1}: TTFT p50 ideal {ideal['ttft_p50']:.3f} s, on/ideal {r['on_vs_ideal_ttft']:.3f}, "
                  f"ideal/off {r['ideal_ttft_ratio']:.3f}", flush=True)
        print(f"-- run {i + 1}: wall on/off {r['wall_ratio']:.3f}, TTFT p50 on/off {r['ttft_ratio']:.3f}, "
              f"p90 on/off {r['ttft_p90_ratio']:.3f}, outputs identical {r['outputs_identical']}", flush=True)
    per_run = [r for _, _, r in pairs]
    keys = ["ttft_ratio", "ttft_p90_ratio", "wall_ratio", "throughput_ratio"]
    if args.ideal_device_tokens:
        keys += ["on_vs_ideal_ttft", "ideal_ttft_ratio"]
    med = {k: statistics.median(r[k] for r in per_run) for k in keys}
    off, on = pairs[0][0], pairs[0][1]
    result = {
        "ttft_p50_off": statistics.median(p[0]["ttft_p50"] for p in pairs),
        "ttft_p50_on": statistics.median(p[1]["ttft_p50"] for p in pairs),
        **med, "outputs_identical": all(r["outputs_identical"] for r in per_run),
        "hit_rate": on["hit_rate"], "reusable_fraction": on["reusable_fraction"], "hit_rate_off": off["hit_rate"],
        "per_run": per_run, "off": off, "on": on,
        "config": {k: v for k, v in vars(args).items() if k != "url"},
    }
    print(f"== TTFT p50 on/off {result['ttft_ratio']:.3f} ({result['ttft_p50_on']:.3f} s / "
          f"{result['ttft_p50_off']:.3f} s), TTFT p90 on/off {result['ttft_p90_ratio']:.3f}, wall on/off "
          f"{result['wall_ratio']:.3f}, throughput on/off {result['throughput_ratio']:.2f}, hit rate "
          f"{on['hit_rate']:.3f} (reusable {on['reusable_fraction']:.3f}, off {off['hit_rate']:.3f}), outputs "
          f"identical {result['outputs_identical']}" + (f" [medians of {args.repeat}]" if args.repeat > 1 else ""))
    if args.ideal_device_tokens:
        print(f"== TTFT p50 on/ideal {result['on_vs_ideal_ttft']:.3f}, ideal/off {result['ideal_ttft_ratio']:.3f} "
              f"(ideal: plain cache, device pool {args.ideal_device_tokens})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
