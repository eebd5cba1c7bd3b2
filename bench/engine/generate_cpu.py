"""CPU generation side by side (issue 24): the server with each --quantize mode, against
transformers' fp32 greedy `generate` in this process, all in one run.

    .venv/bin/python bench/engine/generate_cpu.py [--model random:gpt2] [--modes none,int8,fp16]
        [--streams 1,4,16] [--new-tokens 64] [--prompt-tokens 16] [--rounds 2] [--duration 8]

For each mode a server is started (one process, ephemeral ports); for each stream count, rounds
alternate between transformers (one prompt at a time: the one-stream reference every ratio is
taken against, and a batch of S prompts) and the server's S greedy streams. Reported per row:
- served tokens/s, time per output token and time to first token (p50, from the server's timings);
- served / transformers at one stream, and served / transformers on a batch of S;
- the server's resident memory after the row (VmRSS) and its peak so far (VmHWM), from /proc;
- at one stream, the engine's own decode step (a Generator in this process, same model and
  mode, timed between the rounds): the server's time per token over it is its host overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from gpt2serve.benchmarks.generate_load import TransformersGenerate, serve_from_processes
from gpt2serve.benchmarks.serving_load import make_prompts
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))


def engine_step_ms(generator: Generator, prompt: list[int], new_tokens: int) -> float:
    """Median decode step of one greedy sequence, in this process."""
    generator.prefill([NewSequence(0, prompt, SamplingParams(temperature=0), 0)])
    steps = []
    for _ in range(new_tokens - 1):
        steps.append(generator.decode().forward_s)
    generator.remove({0})
    return 1e3 * statistics.median(steps)


def bench_mode(args, mode: str, prompts: list[list[int]], reference: TransformersGenerate) -> list[dict]:
    extra = ["--quantize", mode, "--workers", "1"]
    proc, target, _ = launch(args.model, None, *extra)
    loaded = load_model(args.model, "cpu", "float32", quantize=mode)
    generator = Generator(Engine(loaded), slots=1)
    generator.warm_up()
    rows = []
    try:
        for streams in [int(s) for s in args.streams.split(",")]:
            served, one, batched, tpot, ttft, steps = [], [], [], [], [], []
            for _ in range(args.rounds):
                one.append(statistics.median(reference.tokens_per_s(prompts[:1], args.new_tokens, args.limit_duration)))
                if streams > 1:
                    batched.append(statistics.median(
                        reference.tokens_per_s(prompts[:streams], args.new_tokens, args.limit_duration)))
                if streams == 1:
                    steps.append(engine_step_ms(generator, prompts[0], args.new_tokens))
                streamed = serve_from_processes(target, prompts, streams, args.new_tokens, args.duration, 1)
                assert not streamed.errors, f"{streamed.errors} errors"
                served.append(streamed.tokens_per_s)
                tpot += streamed.time_per_output_token_ms
                ttft += streamed.time_to_first_token_ms
            rss, peak = memory_mib(proc.pid)
            row = {"mode": mode, "streams": streams, "tokens_per_s": statistics.median(served),
                   "tpot_p50_ms": statistics.median(tpot), "ttft_p50_ms": statistics.median(ttft),
                   "transformers_one_stream_tokens_per_s": statistics.median(one),
                   "vs_transformers_one_stream": statistics.median(s / o for s, o in zip(served, one)),
                   "vs_transformers_batch": statistics.median(s / b for s, b in zip(served, batched or one)),
                   "rss_mib": rss, "peak_rss_mib": peak}
            if steps:
                row["engine_step_ms"] = statistics.median(steps)
                row["tpot_over_engine_step"] = row["tpot_p50_ms"] / row["engine_step_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--modes", default="none,int8,fp16")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of served streams per round")
    parser.add_argument("--limit-duration", type=float, default=4.0, help="seconds of transformers per round")
    args = parser.parse_args()

    fp32 = load_model(args.model, "cpu", "float32")
    reference = TransformersGenerate(fp32)
    prompts = make_prompts(64, args.prompt_tokens, fp32.model.config.vocab_size, seed=0)
    reference.seconds(prompts[:2], 4)  # first-call costs
    started = time.perf_counter()
    rows = [row for mode in args.modes.split(",") for row in bench_mode(args, mode, prompts, reference)]
    print(f"\n{args.model} on a CPU; {args.new_tokens} tokens after {args.prompt_tokens}-token prompts, greedy; "
          f"medians of {args.rounds} alternating rounds; {time.perf_counter() - started:.0f} s")
    print("| --quantize | streams | tokens/s | TPOT p50 | TTFT p50 | / transformers fp32, 1 stream "
          "| / transformers fp32, same batch | RSS (peak) | engine step, TPOT / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        step = (f"{r['engine_step_ms']:.1f} ms, {r['tpot_over_engine_step']:.2f}" if "engine_step_ms" in r else "")
        print(f"| {r['mode']} | {r['streams']} | {r['tokens_per_s']:.0f} | {r['tpot_p50_ms']:.1f} ms "
              f"| {r['ttft_p50_ms']:.0f} ms | {r['vs_transformers_one_stream']:.1f}x "
              f"({r['transformers_one_stream_tokens_per_s']:.1f} tok/s) | {r['vs_transformers_batch']:.1f}x "
              f"| {r['rss_mib']:.0f} MiB ({r['peak_rss_mib']:.0f}) | {step} |")


if __name__ == "__main__":
    main()
