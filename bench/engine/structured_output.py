"""Constrained generation against unconstrained, in one run: the engine in process (the
generator the server runs), random:gpt2 on this machine's default device, the 10-field JSON
schema below against none, sampled at temperature 1, in alternating
rounds. Each round: a prefill of `streams` sequences, then `--steps` decode steps timed (a
constrained sequence whose document is complete goes on taking the end-of-text token its
grammar allows, masked like any other step, so both sides time the same steps). Also the cold
compile of the schema: the front end's check (grammar_for) and the engine's first matcher.

    .venv/bin/python bench/engine/structured_output.py [--streams 1,16] [--steps 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpt2serve.engine.grammar_check import grammar_for
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams

# Ten fields of every JSON Schema kind a form asks for (strings with patterns, bounded numbers,
# enums, an array, a nested object, a nullable field): what docs/benchmarks.md's structured-output
# figures were measured with.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "nickname": {"type": ["string", "null"], "maxLength": 20},
        "level": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["name", "age", "email", "score", "active", "role", "tags", "address", "nickname", "level"],
    "additionalProperties": False,
}


def tokens_per_s(generator: Generator, streams: int, steps: int, params: SamplingParams) -> float:
    sequences = [NewSequence(i, [464, 1110 + i], params, i) for i in range(streams)]
    generator.prefill(sequences)
    started = time.perf_counter()
    for _ in range(steps):
        generator.decode()
    elapsed = time.perf_counter() - started
    generator.remove(set(range(streams)))
    return streams * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(load_model(args.model, args.device, "auto"))
    counts = [int(s) for s in args.streams.split(",")]
    generator = Generator(engine, slots=max(counts))
    generator.warm_up()
    spec = json.dumps(SCHEMA)
    started = time.perf_counter()
    grammar = grammar_for("json_schema", spec, "bench")
    checked = time.perf_counter() - started
    started = time.perf_counter()
    generator.grammars.matcher(grammar)
    first_matcher = time.perf_counter() - started  # includes llguidance's view of the tokenizer, once
    started = time.perf_counter()
    generator.grammars.matcher(grammar_for("json_schema", json.dumps({**SCHEMA, "title": "another"}), "bench"))
    second = time.perf_counter() - started
    print(f"{args.model} on {engine.device}; the schema: front-end check {checked * 1000:.1f} ms, engine's first "
          f"matcher {first_matcher * 1000:.0f} ms (with the tokenizer's setup), another schema's {second * 1000:.1f} ms")
    free = SamplingParams(temperature=1.0)
    constrained = SamplingParams(temperature=1.0, grammar=grammar)
    print("| streams | unconstrained tok/s (rounds) | constrained tok/s (rounds) | constrained / unconstrained |")
    print("|---|---|---|---|")
    for streams in counts:
        plain, masked = [], []
        for _ in range(args.rounds):
            plain.append(tokens_per_s(generator, streams, args.steps, free))
            masked.append(tokens_per_s(generator, streams, args.steps, constrained))
        ratio = statistics.median(m / p for m, p in zip(masked, plain))
        print(f"| {streams} | {' / '.join(f'{v:.1f}' for v in plain)} | {' / '.join(f'{v:.1f}' for v in masked)} | "
              f"**{ratio:.3f}** |")


if __name__ == "__main__":
    main()
