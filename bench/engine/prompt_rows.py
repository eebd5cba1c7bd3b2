"""Next-token batches as prompt rows of one packed forward (engine.step_forward, what
Engine.next_token runs) against the same batch left-padded (Engine._eager, what traced batches
still run), in process, one engine, one run, alternating, the best of --rounds each.

    .venv/bin/python bench/engine/prompt_rows.py [--model random:gpt2] [--quantize int8] [--rounds 5]

Rows run every matrix over the real tokens only and pad attention alone; left padding runs
everything over prompts x the longest. Reported per shape: both times and rows / left (below 1:
rows are faster); both must give the same top tokens.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import plain_asks
from gpt2serve.engine.loading import load_model


def shapes(rng: random.Random) -> dict[str, list[list[int]]]:
    def batch(count: int, shortest: int, longest: int) -> list[list[int]]:
        return [[rng.randrange(50000) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]

    return {"64 x 8": batch(64, 8, 8), "64 x 4-16": batch(64, 4, 16), "16 x 128": batch(16, 128, 128),
            "16 x 20-200": batch(16, 20, 200), "1 x 12": batch(1, 12, 12)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(load_model(args.model, "cpu", "float32", quantize=args.quantize))
    engine.forward_tokens = None  # one forward a batch, for both

    def rows(batch):
        return engine.next_token(plain_asks(batch, [5] * len(batch))).top

    @torch.inference_mode()
    def left(batch):
        return engine._eager(batch, [5] * len(batch), (), time.perf_counter(), time.time_ns()).top

    for name, batch in shapes(random.Random(0)).items():
        same = all(a[0].token_id == b[0].token_id for a, b in zip(rows(batch), left(batch)))
        best = {rows: float("inf"), left: float("inf")}
        for _ in range(args.rounds):
            for path in best:
                started = time.perf_counter()
                path(batch)
                best[path] = min(best[path], time.perf_counter() - started)
        print(f"{args.quantize} {name}: rows {best[rows] * 1e3:.1f} ms, left-padded {best[left] * 1e3:.1f} ms, "
              f"rows / left {best[rows] / best[left]:.2f}, same top tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
