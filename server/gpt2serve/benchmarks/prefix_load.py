"""`gpt2serve bench --shared-prefix`: what the prefix cache buys, against the same server started
with `--prefix-cache-mb 0` (--baseline-target), in one run.

Three workloads, each measured on both servers back to back, for --rounds rounds (the order
alternating, with a pause before each), so drift in a shared machine's speed hits both sides
alike; with an even number of rounds the geometric mean of the ratios cancels any advantage of
going first or second:
- shared next-token: --concurrency closed-loop clients, each request --prefix-tokens shared tokens
  then --suffix-tokens of its own (fresh random ones every request): requests / s;
- shared generation: the same prompts as streamed generations of --gen-tokens tokens: time to
  first token (the server's own, median);
- unshared next-token: fresh random prompts of --unshared-tokens, nothing in common: requests / s
  (the cache's cost where it cannot help: it still keeps every full block).
Every prompt is new, so nothing but the shared prefix can ever be found in the cache. Before
each measurement two requests with the prefix warm both servers alike.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from gpt2serve_client import AsyncClient, Gpt2ServeError

from .serving_load import fetch_info


@dataclass
class Measured:
    value: float  # requests / s, or time to first token (ms)
    requests: int
    errors: int


@dataclass
class Comparison:
    workload: str
    unit: str
    cached: list[Measured]
    baseline: list[Measured]

    @property
    def ratios(self) -> list[float]:
        """Per round: how many times better with the cache (higher throughput or lower latency)."""
        better = (lambda c, b: c / b) if self.unit == "req/s" else (lambda c, b: b / c)
        return [better(c.value, b.value) if c.value and b.value else float("nan")
                for c, b in zip(self.cached, self.baseline)]


def fresh(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


async def next_token_load(target: str, make_prompt, concurrency: int, duration_s: float) -> Measured:
    """Closed loop: each client sends its next request when the last is answered; requests / s of
    those sent and answered within the window."""
    done = errors = 0
    async with AsyncClient(target, timeout=900) as client:
        started = time.perf_counter()
        stop_at = started + duration_s

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                try:
                    await client.next_token(make_prompt(), top_k=5)
                    done += 1
                except Gpt2ServeError:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started  # the last answers may land past the window
    return Measured(done / elapsed, done, errors)


async def generation_load(target: str, make_prompt, concurrency: int, duration_s: float, new_tokens: int) -> Measured:
    """Closed-loop streams; the median of the server's time to first token."""
    ttft, errors = [], 0
    async with AsyncClient(target, timeout=900) as client:
        stop_at = time.perf_counter() + duration_s

        async def stream() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                try:
                    result = await client.generate(make_prompt(), max_tokens=new_tokens, temperature=0, ignore_eos=True)
                    ttft.append(result.timings.time_to_first_token_ms)
                except Gpt2ServeError:
                    errors += 1

        await asyncio.gather(*(stream() for _ in range(concurrency)))
    return Measured(statistics.median(ttft) if ttft else float("nan"), len(ttft), errors)


async def warm(target: str, prompt: list[int]) -> None:
    """The prefix seen twice: kept by the cache's doorkeeper (engine.prefix_cache), so the measured
    load starts with it cached, as it is for an application's steady state."""
    async with AsyncClient(target, timeout=900) as client:
        for _ in range(2):
            await client.next_token(prompt, top_k=1)


def run_prefix_bench(args) -> int:
    info = asyncio.run(fetch_info(args.target, args.ready_timeout))
    vocab = info.architecture.vocab_size
    rng = random.Random(args.seed)
    prefix = fresh(rng, args.prefix_tokens, vocab)
    shared = lambda: prefix + fresh(rng, args.suffix_tokens, vocab)  # noqa: E731
    unshared = lambda: fresh(rng, args.unshared_tokens, vocab)  # noqa: E731
    workloads = {  # key: (name, unit, load)
        "shared": ("shared next-token", "req/s", lambda t: next_token_load(t, shared, args.concurrency, args.duration)),
        "generation": ("shared generation TTFT", "ms", lambda t: generation_load(t, shared, args.concurrency,
                                                                                 args.duration, args.gen_tokens)),
        "unshared": ("unshared next-token", "req/s",
                     lambda t: next_token_load(t, unshared, args.concurrency, args.duration)),
    }
    workloads = {name: (unit, load) for key, (name, unit, load) in workloads.items() if key in args.workloads.split(",")}
    results = [Comparison(name, unit, [], []) for name, (unit, _) in workloads.items()]
    args.rounds = args.rounds or 3
    for round_ in range(args.rounds):
        for comparison, (_, load) in zip(results, workloads.values()):
            sides = [("cached", args.target), ("baseline", args.baseline_target)]
            for side, target in sides if round_ % 2 == 0 else reversed(sides):
                time.sleep(args.settle_s)  # the other server's last work (and the OS's) settles first
                asyncio.run(warm(target, prefix + [0]))
                measured = asyncio.run(load(target))
                getattr(comparison, side).append(measured)
                print(f"round {round_ + 1} {comparison.workload} {side}: {measured.value:.2f} {comparison.unit} "
                      f"({measured.requests} answered, {measured.errors} errors)", file=sys.stderr, flush=True)
    if args.json:
        json.dump({"model": asdict(info), "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                   "unshared_tokens": args.unshared_tokens, "concurrency": args.concurrency,
                   "results": [{**asdict(c), "ratios": c.ratios, "ratio": statistics.median(c.ratios)}
                               for c in results]}, sys.stdout, indent=2)
        print()
    else:
        print(format_prefix_report(info, args, results))
    return 0


def format_prefix_report(info, args, results: list[Comparison]) -> str:
    lines = [f"model {info.model}, {info.dtype} on {info.device}; {args.concurrency} clients, prefix "
             f"{args.prefix_tokens} + {args.suffix_tokens} own tokens (unshared: {args.unshared_tokens}); "
             f"{args.rounds} rounds of {args.duration:.0f} s a side",
             "| workload | with the cache | --prefix-cache-mb 0 | ratio (median) | geometric mean | rounds |",
             "|---|---|---|---|---|---|"]
    for c in results:
        med = lambda side: statistics.median(m.value for m in side)  # noqa: E731
        lines.append(f"| {c.workload} | {med(c.cached):.2f} {c.unit} | {med(c.baseline):.2f} {c.unit} | "
                     f"**{statistics.median(c.ratios):.2f}x** | {statistics.geometric_mean(c.ratios):.2f}x | "
                     f"{', '.join(f'{r:.2f}' for r in c.ratios)} |")
    return "\n".join(lines)


def add_prefix_bench_arguments(parser) -> None:
    parser.add_argument("--shared-prefix", action="store_true",
                        help="compare the server (--target) with the same one started with --prefix-cache-mb 0 "
                             "(--baseline-target) on shared-prefix and unshared prompts")
    parser.add_argument("--baseline-target", default="localhost:50052",
                        help="--shared-prefix: gRPC host:port of the server without the prefix cache")
    parser.add_argument("--prefix-tokens", type=int, default=800, help="--shared-prefix: tokens every prompt shares")
    parser.add_argument("--suffix-tokens", type=int, default=8, help="--shared-prefix: each prompt's own tokens after it")
    parser.add_argument("--unshared-tokens", type=int, default=64, help="--shared-prefix: length of the unshared prompts")
    parser.add_argument("--gen-tokens", type=int, default=4, help="--shared-prefix: tokens per generation")
    parser.add_argument("--workloads", default="shared,generation,unshared",
                        help="--shared-prefix: which to run, of shared (next-token), generation (TTFT), unshared")
    parser.add_argument("--settle-s", type=float, default=5.0, help="--shared-prefix: pause before each measurement")
