"""LoRA adapters mixed in one forward (engine.lora) against the same load on the base alone, in
process, one engine, one run, rounds alternating, the median of --rounds each:

- next-token: a batch of --prompts prompts spread evenly over --adapters adapters, against the
  same batch on the base (Engine.next_token);
- generation: --streams greedy streams spread over --stream-adapters adapters, decode steps after
  one prefill, against the same streams on the base (engine.generator);
- loading one adapter (load_adapter, from a peft-format directory written here), and what it
  holds against the bytes of its weights file.

    .venv/bin/python bench/engine/lora_mixed.py [--model random:gpt2] [--quantize int8] [--rank 8] [--rounds 5]

Adapters are peft's format (adapter_config.json, adapter_model.safetensors, its key names) for
all four of GPT-2's target modules, with random weights: the speed of a LoRA term does not
depend on its values. Ratios are base time / adapter time (1.0: free; the bar is 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.traced_decode import ADAPTER_TRACE_AFTER
from gpt2serve.engine.loading import load_model
from gpt2serve.engine.lora import load_adapter, shapes
from gpt2serve.engine.steps import Ask
from gpt2serve.protocol import SamplingParams
from safetensors.torch import save_file

GREEDY = SamplingParams(temperature=0.0)
PEFT_NAMES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A peft LoRA directory for every block's four target modules, seeded random weights."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.n_layer):
        for ours, (out_features, in_features) in shapes(config).items():
            key = f"base_model.model.transformer.h.{layer}.{PEFT_NAMES[ours]}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["c_attn", "c_proj", "c_fc"],
        "fan_in_fan_out": True, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return directory


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def decode_steps(engine: Engine, prompts: list[list[int]], adapters: list, steps: int) -> float:
    """Seconds a decode step, after one prefill, of these streams under these adapters."""
    generator = Generator(engine, slots=len(prompts))
    generator.prefill([NewSequence(i, p, GREEDY, i, adapter=a) for i, (p, a) in enumerate(zip(prompts, adapters))])
    for _ in range(ADAPTER_TRACE_AFTER):  # untimed: the steps before and at a trace's recording (base or adapters)
        generator.decode()
    seconds = timed(lambda: [generator.decode() for _ in range(steps)]) / steps
    generator.remove({r.seq_id for r in generator.running})
    return seconds


def add_load_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """What both LoRA benches take (this one and bench/serving/lora_served.py): the model, the
    adapters, and the two loads."""
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=8, help="next-token prompts spread over this many")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-adapters", type=int, default=4, help="generation streams spread over this many")
    parser.add_argument("--rounds", type=int, default=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser, rounds=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    engine = Engine(load_model(args.model, "cpu", "float32", quantize=args.quantize))
    engine.warm_up()
    config = engine.model.config
    with tempfile.TemporaryDirectory() as scratch:
        dirs = [write_adapter(Path(scratch) / f"a{i}", config, args.rank, i) for i in range(args.adapters)]
        load_s = []
        for d in dirs:
            started = time.perf_counter()
            adapter = load_adapter(d.name, d, config, max_rank=args.rank)
            load_s.append(time.perf_counter() - started)
        adapters = [load_adapter(d.name, d, config, max_rank=args.rank) for d in dirs]
        file_bytes = (dirs[0] / "adapter_model.safetensors").stat().st_size
    print(f"model {args.model} ({args.quantize}), rank {args.rank}, torch threads {torch.get_num_threads()}")
    print(f"load an adapter: median {statistics.median(load_s) * 1000:.1f} ms (max {max(load_s) * 1000:.1f}); holds "
          f"{adapter.nbytes / 2**20:.2f} MiB of fp32 weights, its file {file_bytes / 2**20:.2f} MiB")

    prompts = [[(37 * i + 11 * j) % 50000 for j in range(args.prompt_tokens)] for i in range(args.prompts)]
    spread = [adapters[i % args.adapters] for i in range(args.prompts)]
    base_asks, lora_asks = [Ask(p, 5) for p in prompts], [Ask(p, 5, adapter=a) for p, a in zip(prompts, spread)]
    streams = prompts[:args.streams]
    gen_spread = [adapters[i % args.stream_adapters] for i in range(args.streams)]
    engine.next_token(base_asks), engine.next_token(lora_asks)  # warm
    base_nt, lora_nt, base_gen, lora_gen = [], [], [], []
    for _ in range(args.rounds):
        base_nt.append(timed(lambda: engine.next_token(base_asks)))
        lora_nt.append(timed(lambda: engine.next_token(lora_asks)))
        base_gen.append(decode_steps(engine, streams, [None] * args.streams, args.steps))
        lora_gen.append(decode_steps(engine, streams, gen_spread, args.steps))
    for what, base, lora in ((f"next-token: {args.prompts} prompts x {args.prompt_tokens} tokens over "
                              f"{args.adapters} adapters", base_nt, lora_nt),
                             (f"generation: {args.streams} streams over {args.stream_adapters} adapters, a decode step",
                              base_gen, lora_gen)):
        b, m = statistics.median(base), statistics.median(lora)
        print(f"{what}: base {b * 1000:.1f} ms, adapters {m * 1000:.1f} ms, ratio {b / m:.2f} "
              f"(rounds: {', '.join(f'{x / y:.2f}' for x, y in zip(base, lora))})")


if __name__ == "__main__":
    main()
