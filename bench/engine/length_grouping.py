"""Does grouping waiting prompts by length pay? The model alone, one run: 64 prompts of mixed
lengths as one left-padded batch, against the groups `scheduling.grouping.plan_batch` picks
(with the fixed cost the server's warm-up measures).

    .venv/bin/python bench/engine/length_grouping.py [--model random:gpt2] [--min-len 5] [--max-len 200]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.loading import load_model
from gpt2serve.scheduling.grouping import plan_batch


def groups_of(lengths: list[int], fixed_cost_tokens: float, max_batch_tokens: int) -> list[list[int]]:
    """Apply plan_batch the way the scheduler does: run the oldest's group, repeat on the rest."""
    left, groups = list(range(len(lengths))), []
    while left:
        chosen = plan_batch([lengths[i] for i in left], 0, max_batch_size=64, max_batch_tokens=max_batch_tokens,
                            fixed_cost_tokens=fixed_cost_tokens)
        groups.append([left[i] for i in chosen])
        left = [i for j, i in enumerate(left) if j not in set(chosen)]
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--min-len", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    engine = Engine(load_model(args.model, "cpu", "float32"))
    engine.warm_up()
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(64)]
    lengths = [len(p) for p in prompts]
    plans = {"one batch": [list(range(64))],
             "plan_batch groups": groups_of(lengths, engine.fixed_cost_tokens, 10**9),
             "plan_batch groups, --max-batch-tokens": groups_of(lengths, engine.fixed_cost_tokens,
                                                                args.max_batch_tokens)}
    seconds = {name: 0.0 for name in plans}
    for _ in range(args.repeats):  # alternate, so drift hits every plan alike
        for name, groups in plans.items():
            started = time.perf_counter()
            for group in groups:
                engine.next_token([prompts[i] for i in group], [5] * len(group))
            seconds[name] += (time.perf_counter() - started) / args.repeats
    report = {
        "model": args.model, "prompt_lengths": [args.min_len, args.max_len],
        "fixed_cost_tokens": round(engine.fixed_cost_tokens, 1),
        "plans": {name: {"groups": [len(g) for g in groups],
                         "padded_tokens": sum(len(g) * max(lengths[i] for i in g) for g in groups),
                         "seconds": round(seconds[name], 2)} for name, groups in plans.items()},
        "real_tokens": sum(lengths),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
