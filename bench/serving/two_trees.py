"""The base request path of this checkout against another one's (a `git worktree` at an older
commit): whether a change that adds a feature costs the requests that do not use it.

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/serving/two_trees.py --against /tmp/before [--model random:gpt2] [--rounds 3]
        [--clients 64] [--streams 16] [--new-tokens 64] [--seconds 8] [--quantize none]

Both servers start once (the other tree's through PYTHONPATH, with this venv) and stay up; each
round measures both, the other tree first in odd rounds and this one first in even ones (so an
order effect cancels): closed-loop gRPC next-token clients, then greedy generation streams
(serving/lora_served.py's loads, with no adapter). Ratios are this tree / the
other (1.0: the same); each round's pair is printed, and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server, serving.lora_served
from local_server import launch  # noqa: E402
from serving.lora_served import generation_load, next_token_load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (its server/ and client/)")
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    flags = ("--device", "cpu", "--dtype", "float32", "--quantize", args.quantize)
    other_env = {**os.environ, "PYTHONPATH": f"{args.against / 'server'}:{args.against / 'client'}"}
    servers = {"other": launch(args.model, other_env, *flags), "this": launch(args.model, None, *flags)}
    try:
        for _, target, _ in servers.values():  # warm both
            asyncio.run(next_token_load(target, [None], args.clients, 2.0, args.prompt_tokens))
        token_ratios, stream_ratios = [], []
        for round_ in range(args.rounds):
            calls, tokens = {}, {}
            for side in ("other", "this") if round_ % 2 == 0 else ("this", "other"):
                target = servers[side][1]
                calls[side] = asyncio.run(next_token_load(target, [None], args.clients, args.seconds, args.prompt_tokens))
                tokens[side] = asyncio.run(generation_load(target, [None], args.streams, args.new_tokens))
            token_ratios.append(calls["this"] / calls["other"])
            stream_ratios.append(tokens["this"] / tokens["other"])
            print(f"round {round_ + 1}: next-token {calls['other']:.1f} / {calls['this']:.1f} calls/s (other / this, "
                  f"{token_ratios[-1]:.2f}); generation {tokens['other']:.0f} / {tokens['this']:.0f} tok/s "
                  f"({stream_ratios[-1]:.2f})", flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{args.model} {args.quantize}: this tree / {args.against}: {args.clients} next-token clients "
          f"{statistics.median(token_ratios):.2f}, {args.streams} streams {statistics.median(stream_ratios):.2f} "
          f"(medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
