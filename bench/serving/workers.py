"""--workers N against --workers 1: two servers up at once, loaded in alternating rounds
(ABBA, so a noisy machine's drift hits both alike), the clients spread over client processes.

    .venv/bin/python bench/serving/workers.py [--model random:tiny] [--workers 2] [--rounds 4] [--round-s 8]
                                      [--clients 64] [--processes 2] [--api grpc|rest]

Prints each round and the ratio of the totals (N workers / 1 worker). No model is loaded in
this process.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from gpt2serve.benchmarks.serving_load import load_from_processes, make_prompts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="each round loads both servers once")
    parser.add_argument("--round-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--api", choices=("grpc", "rest"), default="grpc")
    args = parser.parse_args()

    servers = {f"{n} worker{'s' if n > 1 else ''}": launch(args.model, None, "--workers", str(n))
               for n in (1, args.workers)}
    try:
        prompts = make_prompts(256, 5, 50257)
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(servers)[::-1]
            for name in order:
                _, grpc_target, http_target = servers[name]
                target = grpc_target if args.api == "grpc" else http_target
                load = load_from_processes(args.api, target, prompts, args.clients, args.round_s, 1.0,
                                           args.processes).summary(args.api, args.clients, args.round_s)
                rates[name].append(load.req_per_s)
                print(f"round {round_index}: {name}: {load.req_per_s:.1f} req/s, p50 {load.p50_ms:.1f} ms, "
                      f"mean batch {load.mean_batch_size:.1f}, errors {load.errors}", flush=True)
        one, many = rates.values()
        print(json.dumps({"model": args.model, "api": args.api, "clients": args.clients,
                          "client_processes": args.processes, "req_per_s": rates,
                          "ratio_total": sum(many) / sum(one)}, indent=2))
    finally:
        for proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
