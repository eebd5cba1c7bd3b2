"""A CPU next-token batch in one forward against the parts the engine runs it in (at most
engine.padding.CPU_FORWARD_TOKENS padded tokens each), in process, one engine, one run.

For each shape (prompts x tokens), `Engine.next_token` on the whole batch with the budget off
(`forward_tokens = None`: one forward) and on (as served), alternating, the best of `--rounds`.
A ratio above 1 means the parts are faster.

    .venv/bin/python bench/engine/forward_parts.py [--model random:gpt2] [--quantize int8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import plain_asks
from gpt2serve.engine.loading import load_model
from gpt2serve.engine.padding import CPU_FORWARD_TOKENS, forward_parts

SHAPES = [(8, 512), (16, 256), (16, 128), (64, 32), (4, 64)]


def timed(engine: Engine, batch: list[list[int]], budget: int | None) -> float:
    engine.forward_tokens = budget
    started = time.perf_counter()
    engine.next_token(plain_asks(batch, [1] * len(batch)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(load_model(args.model, "cpu", "float32", quantize=args.quantize))
    print(f"{args.model}, quantize {args.quantize}, budget {CPU_FORWARD_TOKENS} tokens, best of {args.rounds}")
    print("| prompts x tokens | forwards | one forward | in parts | ratio |")
    print("|---|---|---|---|---|")
    for n, length in SHAPES:
        batch = [[(7 * i + 13 * j) % 50000 + 1 for j in range(length)] for i in range(n)]
        timed(engine, batch, None), timed(engine, batch, CPU_FORWARD_TOKENS)  # first-call costs
        whole, parts = [], []
        for _ in range(args.rounds):
            whole.append(timed(engine, batch, None))
            parts.append(timed(engine, batch, CPU_FORWARD_TOKENS))
        forwards = len(forward_parts([length] * n, CPU_FORWARD_TOKENS))
        print(f"| {n} x {length} | {forwards} | {min(whole) * 1000:.0f} ms | {min(parts) * 1000:.0f} ms "
              f"| {min(whole) / min(parts):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
