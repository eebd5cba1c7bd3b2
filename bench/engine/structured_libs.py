"""Which structured-generation library for GPT-2's byte-level vocabulary: xgrammar, llguidance
and outlines-core, measured on the same work in one run.

For each library: its setup over GPT-2's 50,257 tokens (the bytes each stands for, from the
project's tokenizer), the compile of a 10-field JSON schema (nested object, array, enum, string
pattern, bounded numbers), of a regex and of a choice, and the time to make the next-token mask
at every position of a valid document (GPT-2's own tokens of it, each checked to be allowed, then
accepted). Medians of `--rounds`; compiles are timed cold (a new compiler or index each round).

    .venv/bin/pip install --target /tmp/solibs xgrammar llguidance outlines-core  # not project deps yet
    PYTHONPATH=/tmp/solibs .venv/bin/python bench/engine/structured_libs.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

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
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "score": 0.75, "active": True,
                       "role": "admin", "tags": ["math", "poet"], "address": {"city": "London", "zip": "12345"},
                       "nickname": None, "level": 2}, separators=(",", ":"))
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


class Xgrammar:
    name = "xgrammar"

    def __init__(self, token_bytes: list[bytes], eos: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=len(token_bytes), stop_token_ids=[eos])

    def compile(self, kind: str, spec):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_regex("|".join(spec))

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.info.vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - started)
            assert (bitmask[0, token // 32] >> (token % 32)) & 1, f"xgrammar refused token {token}"
            assert matcher.accept_token(token)
        return times


class Llguidance:
    name = "llguidance"

    def __init__(self, token_bytes: list[bytes], eos: int):
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        encode = bundled_gpt2_tokenizer().encode

        class Wrapped:
            eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, token_bytes, [eos]

            def __call__(self, text):
                return encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
        self.allocate = llguidance.numpy.allocate_token_bitmask
        self.fill = llguidance.numpy.fill_next_token_bitmask

    def compile(self, kind: str, spec):
        matcher = self.llg.LLMatcher
        grammar = (matcher.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": False})
                   if kind == "json" else matcher.grammar_from_regex(spec if kind == "regex" else "|".join(spec)))
        compiled = matcher(self.tokenizer, grammar)
        assert not compiled.is_error(), compiled.get_error()
        return grammar

    def walk(self, grammar, tokens: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        bitmask = self.allocate(1, self.tokenizer.vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            self.fill(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"llguidance refused token {token}"
            assert matcher.consume_token(token), matcher.get_error()
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, token_bytes: list[bytes], eos: int):
        from outlines_core import Vocabulary

        self.vocabulary = Vocabulary(eos, {b: [i] for i, b in enumerate(token_bytes) if i != eos and b})

    def compile(self, kind: str, spec):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec if kind == "regex" else \
            "(" + "|".join(spec) + ")"
        return Index(regex, self.vocabulary)

    def walk(self, index, tokens: list[int]) -> list[float]:
        from outlines_core import Guide

        guide = Guide(index)
        times = []
        for token in tokens:
            started = time.perf_counter()
            allowed = guide.get_tokens()
            mask = torch.zeros(50257, dtype=torch.bool)
            mask[allowed] = True
            times.append(time.perf_counter() - started)
            assert mask[token], f"outlines-core refused token {token}"
            guide.advance(token)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    args = parser.parse_args()
    tokenizer = bundled_gpt2_tokenizer()
    token_bytes = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    eos = tokenizer.eos_token_id
    tokens = tokenizer.encode(DOCUMENT)
    print(f"GPT-2's {len(token_bytes)} tokens; the document: {len(DOCUMENT)} characters, {len(tokens)} tokens")
    print("| library | setup ms | JSON schema compile ms | regex ms | choice ms | mask µs a token (median / max) |")
    print("|---|---|---|---|---|---|")
    for cls in (Xgrammar, Llguidance, OutlinesCore):
        if cls.name not in args.libs.split(","):
            continue
        lib, setup_s = timed(lambda: cls(token_bytes, eos))
        compiles = {kind: [] for kind in ("json", "regex", "choice")}
        masks = []
        for _ in range(args.rounds):
            for kind, spec in (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)):
                compiled, seconds = timed(lambda: lib.compile(kind, spec))
                compiles[kind].append(seconds)
                if kind == "json":
                    masks += lib.walk(compiled, tokens)
        ms = {kind: statistics.median(values) * 1000 for kind, values in compiles.items()}
        print(f"| {cls.name} | {setup_s * 1000:.0f} | {ms['json']:.1f} | {ms['regex']:.1f} | {ms['choice']:.1f} | "
              f"{statistics.median(masks) * 1e6:.0f} / {max(masks) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
