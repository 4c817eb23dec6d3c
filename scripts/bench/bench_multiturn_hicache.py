"""HiCache off vs on for the multi-turn benchmark, in one go.

    OMP_NUM_THREADS=1 python scripts/bench/bench_multiturn_hicache.py --json out.json
    python scripts/bench/bench_multiturn_hicache.py --model-path DIR --device-tokens 4096 ...

Starts a server with a device pool of ``--device-tokens`` (smaller than the conversations'
working set) and the plain radix cache, runs bench_multiturn.py against it, stops it, then does
the same with ``--enable-hierarchical-cache`` (host pool ``--hicache-ratio`` times the device
pool), and prints both reports and the ratios. Without ``--model-path`` it builds a model where
prefill dominates (make_tiny_model --hidden 512 --layers 8, as in docs/engine.md).

``--json`` writes ttft_p50_off, ttft_p50_on, ttft_ratio (on / off), throughput_ratio (on / off,
prompt + answer tokens per second), hit_rate (on), reusable_fraction, and both full reports.
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_server(model: str, flags: list[str], args) -> dict:
    with launch_server_process(model, *flags, timeout_s=600) as srv:
        print(f"server {' '.join(flags)}", flush=True)
        return bench(srv.url, args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="default: a prefill-dominated model built into a temp dir")
    parser.add_argument("--device-tokens", type=int, default=4096, help="device KV pool of both servers")
    parser.add_argument("--hicache-ratio", type=float, default=8.0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for both servers")
    parser.add_argument("--json", help="write the ratios and reports to this file")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="bench-multiturn-")
    model = args.model_path or make_tiny_model(os.path.join(tmp.name, "model"), "qwen3", *PREFILL_MODEL)
    common = ["--max-total-tokens", str(args.device_tokens), "--page-size", str(args.page_size), *args.server_flag]
    off = run_server(model, common, args)
    print_report("HiCache off", off)
    on = run_server(model, [*common, "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)], args)
    print_report("HiCache on", on)

    def tput(s: dict) -> float:
        return s["input_throughput"] + s["output_throughput"]

    result = {
        "ttft_p50_off": off["ttft_p50"], "ttft_p50_on": on["ttft_p50"],
        "ttft_ratio": on["ttft_p50"] / off["ttft_p50"], "throughput_ratio": tput(on) / tput(off),
        "hit_rate": on["hit_rate"], "reusable_fraction": on["reusable_fraction"],
        "hit_rate_off": off["hit_rate"], "off": off, "on": on,
        "config": {k: v for k, v in vars(args).items() if k != "url"},
    }
    print(f"== TTFT p50 on/off {result['ttft_ratio']:.3f} ({on['ttft_p50']:.3f} s / {off['ttft_p50']:.3f} s), "
          f"throughput on/off {result['throughput_ratio']:.2f}, hit rate {on['hit_rate']:.3f} "
          f"(reusable {on['reusable_fraction']:.3f}, off {off['hit_rate']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
