"""Served next-token prompts of mixed lengths: two servers, one at a time, rounds alternating.

Each of `--clients` gRPC clients (the project's load generator, gpt2serve.benchmarks.serving_load,
in one process) sends one prompt at a time for `--seconds` after a 2 s warm-up: `--long-share`
of them `--long` tokens, the rest `--short`. Reported per server: prompts per second, latency
p50 / p90, and the mean batch a forward; and the ratio of server B to server A in each round.
Server A runs with the default flags, server B with `--flags-b` added (e.g.
`--fixed-cost-tokens 4096`: the scheduler's length grouping (scheduling.grouping) then never
splits a batch to save padding).

    .venv/bin/python bench/serving/mixed_lengths.py [--model random:gpt2] [--clients 64]
        [--short 5] [--long 200] [--long-share 0.1] [--seconds 15] [--rounds 3]
        [--flags-b "--fixed-cost-tokens 4096"] [--quantize none] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import sys
from pathlib import Path

from gpt2serve.benchmarks.serving_load import load_in_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


def prompt_mix(count: int, short: int, long: int, long_share: float, seed: int) -> list[list[int]]:
    """`count` prompts, each `long` tokens with probability `long_share`, else `short`."""
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(long if rng.random() < long_share else short)]
            for _ in range(count)]


def one_round(model: str, extra: list[str], args: argparse.Namespace, work: list[list[int]]) -> dict:
    """One server's load (gpt2serve.benchmarks.serving_load's closed-loop gRPC clients, after a
    warm-up): prompts a second, latency and the mean batch a forward; then the server stops."""
    proc, target, _ = launch(model, None, "--device", args.device, "--dtype", args.dtype, "--quantize", args.quantize,
                             *extra)
    try:
        result = load_in_process("grpc", target, work, args.clients, args.seconds, 2.0).summary(
            "grpc", args.clients, args.seconds)
        return {"prompts_per_s": result.req_per_s, "p50_ms": result.p50_ms, "p90_ms": result.p90_ms,
                "mean_batch": result.mean_batch_size, "errors": result.errors}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--short", type=int, default=5)
    parser.add_argument("--long", type=int, default=200)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--flags-b", default="--fixed-cost-tokens 4096", help="server B's extra flags")
    args = parser.parse_args()
    work = prompt_mix(512, args.short, args.long, args.long_share, seed=1)
    servers = {"A": [], "B": shlex.split(args.flags_b)}
    rounds = []
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")  # neither always runs first
        result = {name: one_round(args.model, servers[name], args, work) for name in order}
        result["ratio_b_over_a"] = result["B"]["prompts_per_s"] / result["A"]["prompts_per_s"]
        rounds.append(result)
        print(json.dumps({"round": r, **result}), flush=True)
    print(json.dumps({"model": args.model, "clients": args.clients, "mix": [args.short, args.long, args.long_share],
                      "flags_b": args.flags_b, "ratios_b_over_a": [round(x["ratio_b_over_a"], 3) for x in rounds]}))


if __name__ == "__main__":
    main()
