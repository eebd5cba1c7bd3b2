"""Served prompt scoring against the in-process limit of the same forward plus head, in one run,
and the extra peak memory of scoring a batch.

1. In process: the engine scores batches of as many prompts as there are clients (at most 64, the
   server's batch) of `--tokens` tokens each (Engine.next_token with every row scored, top-k 1),
   best of `--rounds`: prompt tokens per second.
2. Served: `--clients` concurrent gRPC clients (AsyncClient, one process), each scoring random
   prompts of the same length one at a time (prompt_logprobs=1) for `--seconds`: prompt tokens
   per second, and the mean batch the server formed. Ratio = served / in-process.
3. Memory: the peak RSS growth while the engine scores `--memory-batch` prompts of the full context,
   against the same batch unscored (the hidden states are there either way), in a fresh process each.

    .venv/bin/python bench/scoring.py [--model random:gpt2] [--tokens 128] [--clients 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import resource
import time

from gpt2serve_client import AsyncClient
from local_server import launch


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(tokens)] for _ in range(count)]


def in_process(model: str, batch: int, tokens: int, rounds: int) -> float:
    from gpt2serve.engine.engine import Engine
    from gpt2serve.engine.loading import load_model

    engine = Engine(load_model(model, "cpu", "float32", seed=0))
    work = prompts(batch, tokens, 1)
    engine.next_token(work, [1] * batch, scored_rows={row: 1 for row in range(batch)})  # warm
    best = min(_timed(lambda: engine.next_token(work, [1] * batch, scored_rows={r: 1 for r in range(batch)}))
               for _ in range(rounds))
    return batch * tokens / best


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


async def served(target: str, clients: int, tokens: int, seconds: float) -> tuple[float, float]:
    scored, batches = 0, []
    deadline = time.monotonic() + seconds

    async def client(index: int) -> None:
        nonlocal scored
        async with AsyncClient(target, timeout=120) as c:
            work = prompts(64, tokens, 100 + index)
            i = 0
            while time.monotonic() < deadline:
                result = await c.next_token(work[i % len(work)], top_k=1, prompt_logprobs=1)
                scored += len(result.prompt_token_ids)
                batches.append(result.batch_size)
                i += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return scored / (time.perf_counter() - started), sum(batches) / max(len(batches), 1)


def _peak_rss_growth(model: str, batch: int, scored: bool, out) -> None:
    from gpt2serve.engine.engine import Engine
    from gpt2serve.engine.loading import load_model

    engine = Engine(load_model(model, "cpu", "float32", seed=0))
    n_ctx = engine.model.config.n_ctx
    work = prompts(batch, n_ctx, 2)
    engine.next_token(work[:1], [1], scored_rows={0: 1} if scored else None)  # first-call allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.next_token(work, [1] * batch, scored_rows={r: 5 for r in range(batch)} if scored else None)
    out.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)  # MiB


def peak_rss_growth_mib(model: str, batch: int, scored: bool) -> float:
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=_peak_rss_growth, args=(model, batch, scored, queue))
    process.start()
    value = queue.get()
    process.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-batch", type=int, default=8)
    args = parser.parse_args()
    report = {"model": args.model, "tokens": args.tokens}
    report["memory_mib"] = {"unscored": peak_rss_growth_mib(args.model, args.memory_batch, False),
                            "scored": peak_rss_growth_mib(args.model, args.memory_batch, True),
                            "batch": args.memory_batch}
    proc, target, _ = launch(args.model, None, "--device", "cpu", "--dtype", "float32")
    try:
        for clients in args.clients:
            limit = in_process(args.model, min(clients, 64), args.tokens, args.rounds)
            rate, mean_batch = asyncio.run(served(target, clients, args.tokens, args.seconds))
            report[f"clients_{clients}"] = {"served_tokens_per_s": round(rate), "in_process_tokens_per_s": round(limit),
                                            "ratio": round(rate / limit, 3), "mean_batch": round(mean_batch, 1)}
            print(json.dumps(report), flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
