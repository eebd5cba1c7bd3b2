"""Served prompt scoring against the in-process limit of the same forward plus head, in one run,
and the extra peak memory of scoring a batch.

1. In process: the engine scores batches of as many prompts as there are clients (at most 64, the
   server's batch) of `--tokens` tokens each (Engine.next_token with every row scored, top-k 1),
   best of `--rounds`: prompt tokens per second.
2. Served: `--clients` concurrent gRPC clients (AsyncClient, one process), each scoring random
   prompts of the same length one at a time (prompt_logprobs=1) for `--seconds`: prompt tokens
   per second, and the mean batch the server formed. Ratio = served / in-process.
3. Memory: the peak RSS growth while the head scores `--memory-batch` prompts of the full context
   (top 5 each), the forward's hidden states already there: chunked as the engine does, and
   whole, (B, T, V) logits at once, as a naive server would; a fresh process each.

    .venv/bin/python bench/serving/scoring.py [--model random:gpt2] [--tokens 128] [--clients 16 64]
                                      [--device cuda --dtype bfloat16]   (scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path

from gpt2serve_client import AsyncClient
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(tokens)] for _ in range(count)]


def in_process(model: str, batch: int, tokens: int, rounds: int, device: str, dtype: str) -> float:
    from gpt2serve.engine.engine import Engine
    from gpt2serve.engine.steps import Ask
    from gpt2serve.engine.loading import load_model

    engine = Engine(load_model(model, device, dtype, seed=0))
    work = prompts(batch, tokens, 1)
    asks = [Ask(p, 1, prompt_logprobs=1) for p in work]
    engine.next_token(asks)  # warm
    best = min(_timed(lambda: engine.next_token(asks)) for _ in range(rounds))
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


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _scoring_peak(model: str, batch: int, chunked: bool, out) -> None:
    """The forward first; then the peak RSS reset (/proc/self/clear_refs) and the head over every
    position: chunked (engine.head), or whole as a naive server would, (B, T, V) at once."""
    import torch

    from gpt2serve.engine.engine import Engine
    from gpt2serve.engine.head import ScoredSpan, score_prompts
    from gpt2serve.engine.loading import load_model
    from gpt2serve.engine.padding import IDS, POSITIONS, VALID, left_pad

    engine = Engine(load_model(model, "cpu", "float32", seed=0))
    n_ctx, vocab = engine.model.config.n_ctx, engine.model.config.vocab_size
    padded = left_pad(prompts(batch, n_ctx, 2), 0)
    with torch.inference_mode():
        hidden = engine.model.hidden_states(padded[IDS], padded[POSITIONS], padded[VALID].bool())  # (B, T, C)
        spans = [ScoredSpan(row, 0, n_ctx, 5) for row in range(batch)]
        score_prompts(hidden[:1, :64], padded[IDS][:1, :64], [ScoredSpan(0, 0, 64, 5)], engine.model.head, vocab)  # warm
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _rss_kib("VmRSS")
        if chunked:
            score_prompts(hidden, padded[IDS], spans, engine.model.head, vocab)
        else:
            logprobs = torch.log_softmax(engine.model.head(hidden[:, :-1]).float(), dim=-1)  # (B, T-1, V)
            logprobs.gather(2, padded[IDS][:, 1:, None])
    out.put((_rss_kib("VmHWM") - before) / 1024)  # MiB


def scoring_peak_mib(model: str, batch: int, chunked: bool) -> float:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_scoring_peak, args=(model, batch, chunked, queue))
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
    parser.add_argument("--memory-batch", type=int, default=8, help="0: no memory figure (it is the CPU's RSS)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    report = {"model": args.model, "tokens": args.tokens, "device": args.device, "dtype": args.dtype}
    if args.memory_batch and args.device == "cpu":
        report["scoring_peak_mib"] = {"batch": args.memory_batch,
                                      "chunked": round(scoring_peak_mib(args.model, args.memory_batch, True)),
                                      "whole": round(scoring_peak_mib(args.model, args.memory_batch, False))}
        print(json.dumps(report), flush=True)
    proc, target, _ = launch(args.model, None, "--device", args.device, "--dtype", args.dtype)
    try:
        for clients in args.clients:
            limit = in_process(args.model, min(clients, 64), args.tokens, args.rounds, args.device, args.dtype)
            rate, mean_batch = asyncio.run(served(target, clients, args.tokens, args.seconds))
            report[f"clients_{clients}"] = {"served_tokens_per_s": round(rate), "in_process_tokens_per_s": round(limit),
                                            "ratio": round(rate / limit, 3), "mean_batch": round(mean_batch, 1)}
            print(json.dumps(report), flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
