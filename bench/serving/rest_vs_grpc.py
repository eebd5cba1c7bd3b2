"""REST vs gRPC throughput on one server, in alternating rounds (the issue 3 REST target).

On a shared 2-core machine the server's forward time drifts by 10-15% from one 10-second run
to the next, more than the difference being measured. So this loads one server with gRPC and
REST in turn (ABBA order, so a drift hits both alike), several rounds, and reports the ratio of
the totals plus each pair's ratio and their spread. The load generators are the ones
`gpt2serve bench` uses; no model is loaded in this process.

    .venv/bin/python bench/serving/rest_vs_grpc.py [--model random:gpt2] [--rounds 6] [--round-s 8] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
from pathlib import Path

from gpt2serve.benchmarks.serving_load import load_grpc, load_rest, make_prompts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--rounds", type=int, default=6, help="each round is one gRPC and one REST run")
    parser.add_argument("--round-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("serve_flags", nargs="*", help="extra flags for gpt2serve serve (after --)")
    args = parser.parse_args()

    proc, grpc_target, http_target = launch(args.model, None, *args.serve_flags)
    loads = {"grpc": lambda: load_grpc(grpc_target, prompts, args.clients, args.round_s, 1.0),
             "rest": lambda: load_rest(http_target, prompts, args.clients, args.round_s, 1.0)}
    try:
        prompts = make_prompts(256, 5, 50257)
        rates: dict[str, list[float]] = {"grpc": [], "rest": []}
        for round_index in range(args.rounds):
            for api in (("grpc", "rest") if round_index % 2 == 0 else ("rest", "grpc")):
                load = asyncio.run(loads[api]()).summary(api, args.clients, args.round_s)
                rates[api].append(load.req_per_s)
                print(f"round {round_index}: {api}: {load.req_per_s:.1f} req/s, mean batch {load.mean_batch_size:.1f},"
                      f" server forward p50 {load.server_forward_p50_ms:.0f} ms, errors {load.errors}", flush=True)
        pair_ratios = [r / g for r, g in zip(rates["rest"], rates["grpc"])]
        report = {
            "model": args.model, "clients": args.clients, "rounds": args.rounds, "round_s": args.round_s,
            "serve_flags": args.serve_flags, "req_per_s": rates,
            "rest_over_grpc_total": sum(rates["rest"]) / sum(rates["grpc"]),
            "rest_over_grpc_per_round": pair_ratios,
            "per_round_median": statistics.median(pair_ratios),
            "per_round_min_max": [min(pair_ratios), max(pair_ratios)],
        }
        print(json.dumps(report, indent=2))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
