"""Generation in process, no server: the engine's Generator (prefill, then one decode step per
token over the KV cache) against transformers' `generate` on the same batch, alternating rounds.
Tells the engine's share of `gpt2serve bench --generate`'s ratio from the serving path's.

    .venv/bin/python bench/engine/generate_engine.py [--model random:gpt2] [--device cpu] [--batch-sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams
from gpt2serve.benchmarks.generate_load import TransformersGenerate


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_seconds(generator: Generator, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill s, mean decode step s) for the batch, greedy, every row to `new_tokens`."""
    greedy = SamplingParams(temperature=0)
    device = generator.engine.device
    started = time.perf_counter()
    generator.prefill([NewSequence(i, p, greedy, 0) for i, p in enumerate(prompts)])
    synchronize(device)
    prefilled = time.perf_counter()
    for _ in range(new_tokens - 1):
        generator.decode()
    synchronize(device)
    decode_s = (time.perf_counter() - prefilled) / max(new_tokens - 1, 1)
    generator.remove(set(range(len(prompts))))
    return prefilled - started, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model(args.model, args.device, args.dtype)
    engine = Engine(loaded)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    generator = Generator(engine, slots=max(sizes))
    generator.warm_up()
    reference = TransformersGenerate(loaded)
    rng = random.Random(0)
    vocab = loaded.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(max(sizes))]

    if not args.json:  # each row as it is measured: a run cut short (a capped GPU check) keeps what it had
        print(f"{args.model}, {args.dtype} on {loaded.device}; {args.new_tokens} tokens after "
              f"{args.prompt_tokens}-token prompts, greedy; medians of {args.rounds} alternating rounds")
        print("| batch | prefill ms | decode step ms | engine decode tokens/s | engine / transformers (whole generate) |")
        print("|---|---|---|---|---|", flush=True)
    rows = []
    for size in sizes:
        batch, ratios, prefill, step = prompts[:size], [], [], []
        reference.seconds(batch, args.new_tokens)  # first-call costs at this batch's shapes (on a GPU, seconds)
        engine_seconds(generator, batch, 2)
        for _ in range(args.rounds):
            prefill_s, decode_s = engine_seconds(generator, batch, args.new_tokens)
            ours = prefill_s + decode_s * (args.new_tokens - 1)
            ratios.append(reference.seconds(batch, args.new_tokens) / ours)
            prefill.append(prefill_s)
            step.append(decode_s)
        r = {"batch": size, "prefill_ms": 1e3 * statistics.median(prefill),
             "decode_step_ms": 1e3 * statistics.median(step), "engine_tokens_per_s": size / statistics.median(step),
             "ratio": statistics.median(ratios), "round_ratios": ratios}
        rows.append(r)
        if not args.json:
            spread = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
            print(f"| {r['batch']} | {r['prefill_ms']:.1f} | {r['decode_step_ms']:.2f} | {r['engine_tokens_per_s']:,.0f} "
                  f"| {r['ratio']:.2f} ({spread}) |", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "device": str(loaded.device), "dtype": args.dtype, "rows": rows},
                         indent=2))

if __name__ == "__main__":
    main()
