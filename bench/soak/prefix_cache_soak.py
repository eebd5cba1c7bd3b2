"""The prefix cache under a burst of distinct prompts for minutes: a server with a small
`--prefix-cache-mb`, and clients that send each new prompt three times (seen, kept by the
doorkeeper, hit) and never again, so the cache fills, then lives by evicting. Every `--sample-s` seconds:
the server's resident memory (all its processes), the cache's queried and hit tokens, requests
answered. Prints the samples and the RSS spread after `--warmup-s`.

    .venv/bin/python bench/soak/prefix_cache_soak.py [--seconds 300] [--cache-mb 64] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import family, launch, rss_mib  # noqa: E402

from gpt2serve_client import AsyncClient


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants (the --workers processes, if any)."""
    return sum(rss_mib(p) for p in family(pid))


def counters(http: str) -> tuple[float, float]:
    text = httpx.get(f"{http}/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("gpt2serve_prefix_cache_")}
    return values.get("gpt2serve_prefix_cache_queries_total", 0.0), values.get("gpt2serve_prefix_cache_hits_total", 0.0)


async def load(target: str, clients: int, tokens: int, stop_at: float, answered: list[int]) -> None:
    rng = random.Random(1)
    async with AsyncClient(target, timeout=300) as client:
        async def worker() -> None:
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(50257) for _ in range(tokens)]
                for last in (1, 2, 3):  # seen, kept, hit; never again
                    await client.next_token(prompt + [last], top_k=1)
                    answered[0] += 1

        await asyncio.gather(*(worker() for _ in range(clients)))


async def sample(proc, http: str, stop_at: float, every: float, answered: list[int], samples: list[dict]) -> None:
    started = time.monotonic()
    while time.monotonic() < stop_at:
        queried, hit = counters(http)
        samples.append({"s": round(time.monotonic() - started), "rss_mib": round(tree_rss_mib(proc.pid), 1),
                        "answered": answered[0], "queried_tokens": queried, "hit_tokens": hit})
        await asyncio.sleep(every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--warmup-s", type=float, default=60)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--cache-mb", type=float, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=255)
    args = parser.parse_args()
    proc, grpc, http = launch(args.model, None, "--prefix-cache-mb", str(args.cache_mb))
    try:
        samples, answered = [], [0]
        stop_at = time.monotonic() + args.seconds

        async def both() -> None:
            await asyncio.gather(load(grpc, args.clients, args.tokens, stop_at, answered),
                                 sample(proc, http, stop_at, args.sample_s, answered, samples))

        asyncio.run(both())
        capacity = httpx.get(f"{http}/v1/model", timeout=10).json()
    finally:
        proc.terminate()
        proc.wait()
    for s in samples:
        print(json.dumps(s))
    after = [s["rss_mib"] for s in samples if s["s"] >= args.warmup_s]
    print(f"cache {capacity.get('prefix_cache_tokens')} tokens ({args.cache_mb} MiB); {answered[0]} requests; "
          f"RSS after {args.warmup_s:.0f} s: {min(after):.0f} - {max(after):.0f} MiB "
          f"(spread {max(after) - min(after):.0f} MiB); hit tokens {samples[-1]['hit_tokens']:.0f} of "
          f"{samples[-1]['queried_tokens']:.0f} queried")


if __name__ == "__main__":
    main()
