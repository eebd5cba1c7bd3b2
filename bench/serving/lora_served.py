"""Served LoRA adapters against the base, in one run on one server, rounds alternating: closed-loop
gRPC next-token clients spread over adapters against the same clients on the base, then greedy
generation streams spread over adapters against the same streams on the base.

    .venv/bin/python bench/serving/lora_served.py [--model random:gpt2] [--quantize int8] [--adapters 8]
        [--clients 64] [--streams 16] [--stream-adapters 4] [--rounds 3] [--seconds 8]

It writes rank --rank adapters in peft's format (bench/engine/lora_mixed.py's, every target module)
and starts `gpt2serve serve --lora-modules ...` on loopback. Ratios are adapters / base (1.0: free;
the issue's bar is 0.8); each round's pair is printed, and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpt2serve_client import AsyncClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server, engine.lora_mixed
from engine.lora_mixed import add_load_arguments, write_adapter  # noqa: E402
from local_server import launch  # noqa: E402


async def next_token_load(target: str, adapters: list[str | None], clients: int, seconds: float,
                          tokens: int) -> float:
    """Calls a second: `clients` closed-loop callers, caller i under adapters[i % len]."""
    rng = random.Random(0)
    done, deadline = 0, time.monotonic() + seconds

    async def caller(client: AsyncClient, adapter: str | None) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await client.next_token([rng.randrange(50000) for _ in range(tokens)], top_k=5, adapter=adapter)
            done += 1

    async with AsyncClient(target) as client:
        started = time.monotonic()
        await asyncio.gather(*(caller(client, adapters[i % len(adapters)]) for i in range(clients)))
        return done / (time.monotonic() - started)


async def generation_load(target: str, adapters: list[str | None], streams: int, new_tokens: int) -> float:
    """Tokens a second of `streams` greedy generations together, stream i under adapters[i % len]."""
    async with AsyncClient(target) as client:
        started = time.monotonic()
        results = await asyncio.gather(*(client.generate(
            [(31 * i + j) % 50000 for j in range(16)], max_tokens=new_tokens, temperature=0, ignore_eos=True,
            adapter=adapters[i % len(adapters)]) for i in range(streams)))
        return sum(len(r.tokens) for r in results) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser, rounds=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    from gpt2serve.engine.loading import load_model
    config = load_model(args.model, "cpu", "float32").model.config
    with tempfile.TemporaryDirectory() as scratch:
        names = [f"a{i}" for i in range(args.adapters)]
        modules = [f"{name}={write_adapter(Path(scratch) / name, config, args.rank, i)}" for i, name in enumerate(names)]
        proc, target, _ = launch(args.model, None, "--device", "cpu", "--dtype", "float32", "--quantize",
                                 args.quantize, "--max-lora-rank", str(args.rank), "--lora-modules", *modules)
        try:
            asyncio.run(next_token_load(target, [None, *names], args.clients, 2.0, args.prompt_tokens))  # warm
            token_ratios, stream_ratios = [], []
            for round_ in range(args.rounds):
                base = asyncio.run(next_token_load(target, [None], args.clients, args.seconds, args.prompt_tokens))
                lora = asyncio.run(next_token_load(target, names, args.clients, args.seconds, args.prompt_tokens))
                token_ratios.append(lora / base)
                base_gen = asyncio.run(generation_load(target, [None], args.streams, args.new_tokens))
                lora_gen = asyncio.run(generation_load(target, names[:args.stream_adapters], args.streams,
                                                       args.new_tokens))
                stream_ratios.append(lora_gen / base_gen)
                print(f"round {round_ + 1}: next-token {base:.1f} / {lora:.1f} calls/s (base / {args.adapters} "
                      f"adapters, {lora / base:.2f}); generation {base_gen:.0f} / {lora_gen:.0f} tok/s (base / "
                      f"{args.stream_adapters} adapters, {lora_gen / base_gen:.2f})", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{args.model} {args.quantize}: {args.clients} next-token clients over {args.adapters} adapters "
          f"{statistics.median(token_ratios):.2f} of base; {args.streams} streams over {args.stream_adapters} "
          f"adapters {statistics.median(stream_ratios):.2f} of base (medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
