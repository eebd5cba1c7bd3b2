"""Running streams while a long prompt arrives, with its prompt read whole or in chunks
(engine.chunked_prefill), in one run: the engine core in this process over a real model.

    .venv/bin/python bench/engine/chunked_prefill.py [--model random:gpt2] [--streams 4]
        [--long-tokens 900] [--wave 0] [--wave-tokens 200] [--chunks 0,512,128] [--rounds 2]

Each round: S greedy streams run; once each has 8 tokens, one long prompt (--long-tokens, 4 new
tokens) arrives, or with --wave N that many distinct prompts of --wave-tokens together, and the
streams go on until every one has its first token. Reported per chunk size (0: read whole): the
longest gap between two tokens of a running stream while the prompts were read, their median gap
over the same window, and the prompts' time to first token (the median and the last for a wave).
Rounds alternate between the chunk sizes, after one round of each that is not counted (a decode
step traces itself once per attention span, engine.traced_decode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import GenerateRequest, SamplingParams, TokenEvent
from gpt2serve.scheduling.core import EngineCore, new_engine_thread

GREEDY = SamplingParams(temperature=0.0)


class Stamps:
    """A sink that notes when each token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.done = asyncio.Event()

    def put(self, event: TokenEvent) -> None:
        self.times.append(time.perf_counter())
        if event.finish_reason:
            self.done.set()

    def fail(self, error: Exception) -> None:  # aborted at the round's end: nothing to tell
        self.done.set()


async def one_round(core: EngineCore, generator: Generator, chunk: int, streams: int, arriving: list[list[int]]
                    ) -> dict:
    generator.chunked.chunk_tokens = chunk  # read when the long prompt is admitted
    sinks = [Stamps() for _ in range(streams)]
    ids = [core.add(GenerateRequest([100 + i, 200 + i, 300 + i], GREEDY, 1000), s) for i, s in enumerate(sinks)]
    while min(len(s.times) for s in sinks) < 8:
        await asyncio.sleep(0.005)
    new_sinks, arrived = [Stamps() for _ in arriving], time.perf_counter()
    ids += [core.add(GenerateRequest(prompt, GREEDY, 4), sink) for prompt, sink in zip(arriving, new_sinks)]
    while not all(sink.times for sink in new_sinks):
        await asyncio.sleep(0.005)
    firsts = sorted(sink.times[0] for sink in new_sinks)
    first = firsts[-1]
    while min(s.times[-1] for s in sinks) <= first:  # each stream's gap across the prompt's last step
        await asyncio.sleep(0.005)
    for seq_id in ids:
        core.abort(seq_id)
    while generator.running or generator.chunked:
        await asyncio.sleep(0.005)
    gaps = [b - a for s in sinks for a, b in zip(s.times, s.times[1:]) if b > arrived and a <= first]
    return dict(longest_gap_ms=1e3 * max(gaps), median_gap_ms=1e3 * statistics.median(gaps),
                ttft_ms=1e3 * (statistics.median(firsts) - arrived), last_ttft_ms=1e3 * (first - arrived))


async def run(args) -> dict[int, list[dict]]:
    thread = new_engine_thread()  # the core's; the model is loaded there too (see scheduling.core)
    engine = thread.submit(lambda: Engine(load_model(args.model, "cpu", "float32"))).result()
    arriving = [[(7 * j + 3 + 101 * w) % 50257 for j in range(args.wave_tokens)] for w in range(args.wave)] \
        or [[(7 * j + 3) % 50257 for j in range(args.long_tokens)]]
    generator = Generator(engine, slots=args.streams + len(arriving))
    thread.submit(generator.warm_up).result()
    core = EngineCore(generator, max_batch_size=64, max_batch_delay_s=0.001, max_queue=64,
                      max_batch_tokens=args.max_batch_tokens, engine_thread=thread)
    core.start()
    chunks = [int(c) for c in args.chunks.split(",")]
    results: dict[int, list[dict]] = {c: [] for c in chunks}
    try:
        for chunk in chunks:  # a round of each first, not counted: decode traces for every span used
            await one_round(core, generator, chunk, args.streams, arriving)
        for _ in range(args.rounds):
            for chunk in chunks:
                results[chunk].append(await one_round(core, generator, chunk, args.streams, arriving))
    finally:
        await core.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=900)
    parser.add_argument("--wave", type=int, default=0, help="this many prompts arrive together instead")
    parser.add_argument("--wave-tokens", type=int, default=200)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--chunks", default="0,512,128")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    what = f"{args.wave} prompts of {args.wave_tokens} tokens arrive" if args.wave else \
        f"a {args.long_tokens}-token prompt arrives"
    print(f"{args.streams} streams running, {what} ({args.model}, fp32, CPU); per round")
    print("| prompt read | longest gap of a running stream, ms | median gap, ms | TTFT (median), ms | last TTFT, ms |")
    print("|---|---|---|---|---|")
    for chunk, rows in results.items():
        name = "whole" if chunk == 0 else f"in chunks of {chunk}"
        cells = [" / ".join(f"{r[key]:.0f}" for r in rows)
                 for key in ("longest_gap_ms", "median_gap_ms", "ttft_ms", "last_ttft_ms")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
