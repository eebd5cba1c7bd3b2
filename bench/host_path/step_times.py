"""What one engine step costs on a device, and how much of it is the device: the figures the
host-path bench's stand-in (bench/host_path/host_path.py) replays.

For decode steps at S running sequences (5-token prompts, greedy, 64 steps each) and next-token
forwards of B 5-token prompts, it reports:
- step_ms: the step as the engine runs it today, host work included (median wall time of
  Generator.decode / Engine.next_token, each ending in its one copy to the host);
- device_ms: the device alone, from CUDA events around N back-to-back replays of the same step's
  graph with no host round trip between them (what a fully overlapped loop would wait for).
On a CPU both are wall times of the same call (nothing overlaps there).

    .venv/bin/python bench/host_path/step_times.py --device cuda --dtype bfloat16 [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpt2serve.engine.engine import Engine, EngineOptions
from gpt2serve.engine.steps import plain_asks
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.kv_cache import blocks_needed
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams

PROMPT = [464, 3139, 286, 4881, 318]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(device: torch.device, run, repeats: int) -> float:
    """Mean device time of `run` over back-to-back repeats (CUDA events); wall time on a CPU."""
    run()
    sync(device)
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        return (time.perf_counter() - started) / repeats * 1000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def decode_steps(engine: Engine, streams: list[int], steps: int) -> list[dict]:
    slots = max(streams)
    generator = Generator(engine, slots, blocks_needed(slots, engine.model.config.n_ctx))
    generator.warm_up()
    results = []
    greedy = SamplingParams(temperature=0.0)
    for s in streams:
        generator.prefill([NewSequence(i, PROMPT, greedy, i) for i in range(s)])
        walls = []
        for _ in range(steps):
            started = time.perf_counter()
            generator.decode()  # ends in its one copy to the host
            walls.append(time.perf_counter() - started)
        rows = generator.running
        lengths = [r.length for r in rows]
        if generator.graphs is not None:
            generator.graphs.run_decode(generator.last_ids[:len(rows)], lengths)  # stage this step's inputs once
            shape = generator.graphs.buckets.shape_for(len(rows), max(lengths) + 1)
            bucket = generator.graphs.ready[shape]
            replay = bucket.graph.replay if bucket.graph is not None else (lambda: generator.graphs._step(bucket))
        else:
            replay = generator.decode
        device = device_ms(engine.device, replay, steps)
        results.append(dict(kind="decode", rows=s, step_ms=statistics.median(walls) * 1000, device_ms=device,
                            at_length=max(lengths) + 1))
        generator.remove({r.seq_id for r in generator.running})
    return results


def next_token_forwards(engine: Engine, batches: list[int], repeats: int) -> list[dict]:
    results = []
    for b in batches:
        prompts = [PROMPT] * b
        engine.next_token(plain_asks(prompts, [5] * b))
        walls = []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.next_token(plain_asks(prompts, [5] * b))
            walls.append(time.perf_counter() - started)
        if engine.graphs is not None:
            shape = engine.graphs.buckets.shape_for(b, len(PROMPT))
            bucket = engine.graphs.ready.get(shape)
            replay = bucket.graph.replay if bucket is not None and bucket.graph is not None \
                else (lambda: engine.next_token(plain_asks(prompts, [5] * b)))
        else:
            replay = lambda: engine.next_token(plain_asks(prompts, [5] * b))  # noqa: E731
        results.append(dict(kind="next_token", rows=b, step_ms=statistics.median(walls) * 1000,
                            device_ms=device_ms(engine.device, replay, repeats)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model, args.device, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(loaded, EngineOptions(max_batch_size=max(batches)))
    engine.warm_up()
    with torch.inference_mode():
        rows = next_token_forwards(engine, batches, args.steps)
        rows += decode_steps(engine, [int(s) for s in args.streams.split(",")], args.steps)
    name = torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu"
    if args.json:
        print(json.dumps(dict(model=args.model, device=name, dtype=str(loaded.dtype), steps=rows)))
        return
    print(f"{args.model} on {name}, {loaded.dtype}")
    print("| step | rows | step ms (host included) | device ms | device share |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['rows']} | {r['step_ms']:.3f} | {r['device_ms']:.3f} | "
              f"{r['device_ms'] / r['step_ms']:.2f} |")


if __name__ == "__main__":
    main()
