"""`gpt2serve bench --generate`: concurrent generation streams against a running server, and in
the same run transformers' own `generate` on a batch of the same prompts in this process.

Each of S streams asks for --new-tokens tokens (greedy, past end-of-text), again and again for
--duration seconds; the served rate is all tokens received / wall time. transformers' side is
one `generate(batch of S)` call after another for --limit-duration seconds (at least one).
With --processes P, the streams are spread over P client processes (their rates add up).
The two sides alternate for --rounds rounds; each round's ratio comes from a pair measured back
to back, so drift in a shared machine's speed hits both sides alike, and the report gives the
median ratio and every round's.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from gpt2serve_client import AsyncClient, Gpt2ServeError, ModelInfo

from .serving_load import fetch_info, make_prompts


@dataclass
class StreamsResult:
    streams: int
    tokens: int
    tokens_per_s: float
    time_per_output_token_p50_ms: float
    time_to_first_token_p50_ms: float
    errors: int
    busiest_client: float  # the busiest client process's CPU over its window, in cores (1.0: saturated)
    transformers_tokens_per_s: float  # its generate on a batch of `streams` prompts, median of rounds
    ratio: float  # median over rounds of served / transformers, each pair measured back to back
    round_ratios: list[float]


@dataclass
class ServedStreams:
    tokens_per_s: float  # the client processes' rates added up
    tokens: int
    time_per_output_token_ms: list[float]  # per request
    time_to_first_token_ms: list[float]
    errors: int
    busiest_client: float  # CPU cores the busiest client process used over its window


async def serve_streams(target: str, prompts: list[list[int]], streams: int, new_tokens: int, duration_s: float
                        ) -> tuple[int, float, list[float], list[float], int, float]:
    """(tokens, seconds, per-request time per output token, time to first token, errors, this
    process's CPU seconds over the same window)."""
    tokens, tpot, ttft, errors = 0, [], [], 0
    async with AsyncClient(target, timeout=600) as client:
        await client.generate(prompts[0], max_tokens=2, temperature=0)  # connection and first-call costs
        started, cpu_started = time.perf_counter(), time.process_time()
        stop_at = started + duration_s

        async def stream(index: int) -> None:
            nonlocal tokens, errors
            i = index
            while time.perf_counter() < stop_at:
                try:
                    result = await client.generate(prompts[i % len(prompts)], max_tokens=new_tokens, temperature=0,
                                                   ignore_eos=True)
                except Gpt2ServeError:
                    errors += 1
                    continue
                tokens += result.usage.completion_tokens
                tpot.append(result.timings.time_per_output_token_ms)
                ttft.append(result.timings.time_to_first_token_ms)
                i += streams

        await asyncio.gather(*(stream(i) for i in range(streams)))
        return tokens, time.perf_counter() - started, tpot, ttft, errors, time.process_time() - cpu_started


def streams_in_process(target: str, prompts: list[list[int]], streams: int, new_tokens: int, duration_s: float
                       ) -> tuple[int, float, list[float], list[float], int, float]:
    """One client process's share of the streams (a top-level function, for --processes)."""
    return asyncio.run(serve_streams(target, prompts, streams, new_tokens, duration_s))


def serve_from_processes(target: str, prompts: list[list[int]], streams: int, new_tokens: int, duration_s: float,
                         processes: int) -> ServedStreams:
    """The streams spread over client processes, each on its own connection (so, with
    --workers, its own front end): one client process receiving a message per token is otherwise
    what gets measured, and `busiest_client` near 1.0 says it still is. Each process's rate is
    measured over its own window; the rates add up."""
    processes = max(1, min(processes, streams))
    if processes == 1:
        parts = [streams_in_process(target, prompts, streams, new_tokens, duration_s)]
    else:
        shares = [streams // processes + (i < streams % processes) for i in range(processes)]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            parts = pool.starmap(streams_in_process, [(target, prompts[i::processes], share, new_tokens, duration_s)
                                                      for i, share in enumerate(shares)])
    return ServedStreams(sum(tokens / seconds for tokens, seconds, *_ in parts), sum(p[0] for p in parts),
                         [x for p in parts for x in p[2]], [x for p in parts for x in p[3]], sum(p[4] for p in parts),
                         max(p[5] / p[1] for p in parts))


class TransformersGenerate:
    """transformers' GPT2LMHeadModel with a loaded model's weights, device and dtype."""

    def __init__(self, loaded):
        import torch  # lazy, here and below: the load client itself needs no torch

        from ..engine.convert import to_transformers

        self.torch, self.device = torch, loaded.device
        self.model = to_transformers(loaded.model).to(device=loaded.device, dtype=loaded.dtype).eval()

    @classmethod
    def like(cls, info: ModelInfo) -> TransformersGenerate:
        """With the server's architecture and dtype, on this machine."""
        from ..engine.loading import build_model_like

        return cls(build_model_like(info))

    def seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def tokens_per_s(self, prompts: list[list[int]], new_tokens: int, duration_s: float) -> list[float]:
        """Per-call rates for about `duration_s` (at least one call)."""
        rates, stop_at = [], time.perf_counter() + duration_s
        while time.perf_counter() < stop_at or not rates:
            rates.append(len(prompts) * new_tokens / self.seconds(prompts, new_tokens))
        return rates


def run_generate_bench(args) -> int:
    info = asyncio.run(fetch_info(args.target, args.ready_timeout))
    stream_counts = [int(s) for s in args.streams.split(",")]
    prompts = make_prompts(max(stream_counts) * 4, args.prompt_tokens, info.architecture.vocab_size, args.seed)
    reference = TransformersGenerate.like(info)
    rounds, results = args.rounds or 3, []
    for streams in stream_counts:
        batch = prompts[:streams]
        served_rates, limit_rates, ratios, tpot, ttft, tokens, errors, busiest = [], [], [], [], [], 0, 0, 0.0
        # This batch's first-call costs, at every sequence length the timed calls reach: on a GPU
        # some kernels are chosen per shape, and a call at new lengths ran 10x slower on an H200.
        reference.seconds(batch, args.new_tokens)
        # Alternating rounds, each ratio from a pair measured back to back: a shared machine's
        # speed drifts by more than the difference we look for.
        for _ in range(rounds):
            limit = statistics.median(reference.tokens_per_s(batch, args.new_tokens, args.limit_duration))
            served = serve_from_processes(args.target, prompts, streams, args.new_tokens, args.duration,
                                          args.processes)
            served_rates.append(served.tokens_per_s)
            limit_rates.append(limit)
            ratios.append(served_rates[-1] / limit)
            tokens, errors = tokens + served.tokens, errors + served.errors
            busiest = max(busiest, served.busiest_client)
            tpot += served.time_per_output_token_ms
            ttft += served.time_to_first_token_ms
        results.append(StreamsResult(streams, tokens, statistics.median(served_rates),
                                     statistics.median(tpot) if tpot else float("nan"),
                                     statistics.median(ttft) if ttft else float("nan"), errors, busiest,
                                     statistics.median(limit_rates), statistics.median(ratios),
                                     ratios))
    if args.json:
        json.dump({"model": asdict(info), "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
                   "rounds": rounds, "results": [asdict(r) for r in results]}, sys.stdout, indent=2)
        print()
    else:
        print(format_generate_report(info, args.new_tokens, args.prompt_tokens, rounds, results))
    return 0 if all(r.tokens for r in results) else 1


def format_generate_report(info: ModelInfo, new_tokens: int, prompt_tokens: int, rounds: int,
                           results: list[StreamsResult]) -> str:
    lines = [f"model {info.model} ({info.weights} weights), {info.dtype} on {info.device}; "
             f"streams of {new_tokens} tokens after {prompt_tokens}-token prompts, greedy; "
             f"medians of {rounds} alternating round(s)",
             "| streams | served tokens/s | time per output token p50 | time to first token p50 "
             "| transformers generate (batch) tokens/s | served / transformers | busiest client process |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.streams} | {r.tokens_per_s:.0f} | {r.time_per_output_token_p50_ms:.1f} ms "
                     f"| {r.time_to_first_token_p50_ms:.1f} ms | {r.transformers_tokens_per_s:.0f} "
                     f"| {r.ratio:.2f} ({', '.join(f'{x:.2f}' for x in r.round_ratios)}) "
                     f"| {r.busiest_client:.2f} cores{' (saturated: the clients set this rate)' if r.busiest_client > 0.9 else ''} |"
                     + (f" ({r.errors} errors)" if r.errors else ""))
    return "\n".join(lines)


def add_generate_bench_arguments(parser) -> None:
    parser.add_argument("--generate", action="store_true",
                        help="generation streams against transformers' generate (see benchmarks.generate_load)")
    parser.add_argument("--streams", default="1,16,64", help="--generate: comma-separated concurrent streams")
    parser.add_argument("--new-tokens", type=int, default=64, help="--generate: tokens per stream")
