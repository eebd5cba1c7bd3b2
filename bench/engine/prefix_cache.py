"""The prefix cache's forwards in process, one engine, one run: what a batch of prompts behind a
shared prefix costs computed whole, from the cache in the rows layout (a gather per prompt), and
packed (one gather for the batch); and what the cache costs batches it cannot help.

1. `--clients` prompts of `--prefix` shared tokens + `--suffix` of their own (fresh each batch):
   - whole: the prefix cache off (every token computed);
   - rows: the cache on, engine.step_forward.PACK_FACTOR set to 0 (each prompt gathers its own);
   - packed: the cache on, as served.
2. `--clients` fresh prompts of `--unshared` tokens (nothing in common): the cache off against on
   (its doorkeeper hashes every full block and keeps none), alternating, median of `--rounds`.

    .venv/bin/python bench/engine/prefix_cache.py [--model random:gpt2] [--clients 16] [--prefix 800]
                                           [--device cuda --dtype bfloat16]   (scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from gpt2serve.engine import step_forward
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import plain_asks
from gpt2serve.engine.loading import load_model
from gpt2serve.engine.prefix_cache import PrefixCache

RNG = random.Random(0)


def fresh(n: int) -> list[int]:
    return [RNG.randrange(50257) for _ in range(n)]


def timed(engine: Engine, batch: list[list[int]]) -> float:
    started = time.perf_counter()
    engine.next_token(plain_asks(batch, [5] * len(batch)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=800)
    parser.add_argument("--suffix", type=int, default=8)
    parser.add_argument("--unshared", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-mb", type=float, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = Engine(load_model(args.model, args.device, args.dtype, seed=0))
    engine.warm_up()
    blocks = int(args.cache_mb * 2**20 // PrefixCache.bytes_per_block(engine.model.config, engine.loaded.dtype))
    prefix = fresh(args.prefix)
    shared = lambda: [prefix + fresh(args.suffix) for _ in range(args.clients)]  # noqa: E731
    unshared = lambda: [fresh(args.unshared) for _ in range(args.clients)]  # noqa: E731

    engine.attach_prefix_cache(0)
    whole = timed(engine, shared())  # seconds: one is enough, and long
    engine.attach_prefix_cache(blocks)
    for _ in range(2):  # seen, then kept (the doorkeeper)
        timed(engine, shared())
    packed_factor = step_forward.PACK_FACTOR
    packed, rows = [], []
    for _ in range(args.rounds):
        step_forward.PACK_FACTOR = 0.0
        rows.append(timed(engine, shared()))
        step_forward.PACK_FACTOR = packed_factor
        packed.append(timed(engine, shared()))
    off, on = [], []
    for _ in range(args.rounds):
        engine.attach_prefix_cache(0)
        off.append(timed(engine, unshared()))
        engine.attach_prefix_cache(blocks)
        on.append(timed(engine, unshared()))
    report = {
        "batch": f"{args.clients} x ({args.prefix} shared + {args.suffix})",
        "whole_s": whole, "rows_s": statistics.median(rows), "packed_s": statistics.median(packed),
        "whole_over_rows": whole / statistics.median(rows), "whole_over_packed": whole / statistics.median(packed),
        "unshared": f"{args.clients} x {args.unshared}", "unshared_off_s": statistics.median(off),
        "unshared_on_s": statistics.median(on), "unshared_off_over_on": statistics.median(o / n for o, n in zip(off, on)),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
