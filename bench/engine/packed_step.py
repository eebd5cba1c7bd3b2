"""What packing saves: a decode step that carries next-token prompts (riders), a long prompt's
next chunk, or new generations' prompts (joining) in its own forward (engine.step_forward),
against the same work as separate forwards (the decode step, then the prompts' own forward, the
chunk's, or a prefill), in one run, alternating rounds, in process.

    .venv/bin/python bench/engine/packed_step.py [--model random:gpt2] [--streams 4,16]
        [--riders 8] [--rider-tokens 12] [--chunk 128] [--joining 4] [--rounds 30]

Reported per stream count and kind: the median time of the packed step and of the separate
forwards, and their ratio (below 1: packing is cheaper).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.steps import Ask, StepPlan, plain_asks
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
LONG_ID = 10**6
JOINING_ID = 2 * 10**6


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


class Bench:
    def __init__(self, engine: Engine, streams: int, riders: int, rider_tokens: int, chunk: int, joining: int):
        self.engine, self.joining_count = engine, joining
        self.generator = Generator(engine, slots=streams + 1 + joining, chunk_tokens=chunk)
        self.generator.prefill([NewSequence(i, [100 + i, 200 + i, 300 + i], GREEDY, i) for i in range(streams)])
        self.riders = [[(11 * j + r) % 50000 for j in range(rider_tokens)] for r in range(riders)]
        self.long = [(7 * j + 3) % 50000 for j in range(8 * chunk)]

    def chunk_ready(self) -> None:
        """A long prompt queued, its next chunk the same size every round (its first ones only)."""
        g = self.generator
        if g.chunked and g.chunked.oldest.done + 2 * g.chunked.chunk_tokens >= len(self.long):
            g.remove({LONG_ID})
        if not g.chunked:
            g.chunk_if_long(NewSequence(LONG_ID, self.long, GREEDY, 0))

    def joining(self) -> list[NewSequence]:
        """New generations with the riders' prompts; the last round's leave first."""
        self.generator.remove({JOINING_ID + i for i in range(len(self.riders))})
        return [NewSequence(JOINING_ID + i, p, GREEDY, i) for i, p in enumerate(self.riders[:self.joining_count])]

    def packed(self, kind: str) -> float:
        g = self.generator
        if kind == "riders":
            return timed(lambda: g.decode([Ask(p, 5) for p in self.riders]))
        if kind == "joining":
            joining = self.joining()
            return timed(lambda: g.decode(joining=joining))
        self.chunk_ready()
        return timed(lambda: g.decode(chunk=True))

    def separate(self, kind: str) -> float:
        g = self.generator
        if kind == "riders":
            return timed(lambda: (g.decode(), self.engine.next_token(plain_asks(self.riders, [5] * len(self.riders)))))
        if kind == "joining":
            joining = self.joining()
            return timed(lambda: (g.decode(), g.prefill(joining)))
        self.chunk_ready()
        chunk_alone = StepPlan(decode=False, chunk=g.chunked.chunk_tokens)
        return timed(lambda: (g.decode(), g.finish(g.launch(chunk_alone))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--streams", default="4,16")
    parser.add_argument("--riders", type=int, default=8)
    parser.add_argument("--rider-tokens", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--joining", type=int, default=4, help="new generations (at most --riders)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    engine = Engine(load_model(args.model, "cpu", "float32"))
    results = []
    for streams in (int(s) for s in args.streams.split(",")):
        bench = Bench(engine, streams, args.riders, args.rider_tokens, args.chunk, min(args.joining, args.riders))
        for kind in ("riders", "chunk", "joining"):
            for _ in range(3):  # first calls: allocations, traces per span
                bench.packed(kind), bench.separate(kind)
            packed, separate = [], []
            for _ in range(args.rounds):
                packed.append(bench.packed(kind))
                separate.append(bench.separate(kind))
            p, s = statistics.median(packed), statistics.median(separate)
            results.append(dict(streams=streams, kind=kind, packed_ms=1e3 * p, separate_ms=1e3 * s, ratio=p / s))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.model}, fp32, CPU; riders: {args.riders} of {args.rider_tokens} tokens; chunk: {args.chunk} "
          f"tokens; joining: {args.joining} of {args.rider_tokens} tokens; median of {args.rounds} alternating rounds")
    print("| streams | rides the decode step | packed step, ms | decode step + own forward (or prefill), ms | ratio |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['streams']} | {r['kind']} | {r['packed_ms']:.1f} | {r['separate_ms']:.1f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
