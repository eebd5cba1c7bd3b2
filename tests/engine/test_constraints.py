"""Structured output (engine.constraints): under every constraint each output parses and
validates, or ends at max_tokens ("length") on a prefix the grammar still accepts. A hypothesis
fuzz over JSON schemas (nested objects, arrays, enums, string patterns, numbers with bounds),
regexes and choices, sampled from random:gpt2 in batches of eight; schemas validated with the
`jsonschema` package. Also: a grammar that does not compile is refused quoting llguidance, and a
constrained row leaves its neighbours' tokens as they were."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt2serve.engine.grammar_check import grammar_for
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.errors import InvalidArgument
from gpt2serve.protocol import SamplingParams

EOS = 50256
MAX_TOKENS = 96
BATCH = 8

names = st.sampled_from(["id", "name", "size", "kind", "tags", "inner", "score", "flag"])
leaves = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 1.5}, st.integers(-5, 5)),
    st.just({"type": "boolean"}),
    st.builds(lambda words: {"enum": words}, st.lists(st.sampled_from(["red", "green", "blue", "x y", "ok"]),
                                                      min_size=1, max_size=3, unique=True)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}, st.integers(1, 4)),
    st.just({"type": "null"}),
)


def objects(children):
    return st.dictionaries(names, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


schemas = st.recursive(leaves, lambda children: st.one_of(
    objects(children), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                                 children, st.integers(0, 3))), max_leaves=5)
regexes = st.sampled_from([r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-f0-9]{2,6}", r"[A-Z][a-z]{0,5} [0-9]+",
                           r"(ab)+c?", r"\d{1,2}:\d{2}"])
choices = st.lists(st.text("abcdefghij ", min_size=1, max_size=8), min_size=1, max_size=4, unique=True)
constraints = st.one_of(schemas.map(lambda s: ("json_schema", json.dumps(s))), regexes.map(lambda r: ("regex", r)),
                        choices.map(lambda c: ("choice", json.dumps(c))))


@pytest.fixture(scope="module")
def generator():
    engine = Engine(load_model("random:gpt2", "cpu", "float32", seed=0))
    return Generator(engine, slots=BATCH)


def run(generator: Generator, params: list[SamplingParams], prompts=None) -> list[tuple[list[int], str]]:
    """Each sequence's tokens and finish ("eos" or "length"), all in one batch."""
    prompts = prompts or [[464, 1110 + i] for i in range(len(params))]
    first = generator.prefill([NewSequence(i, p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))])
    tokens = {i: [t.token_id] for i, t in first.tokens.items()}
    finish = {i: "eos" for i, ts in tokens.items() if ts[-1] == EOS}
    while len(finish) < len(params):
        step = generator.decode()
        assert not step.failed, step.failed
        for i, t in step.tokens.items():
            if i in finish:
                continue
            tokens[i].append(t.token_id)
            if t.token_id == EOS:
                finish[i] = "eos"
            elif len(tokens[i]) == MAX_TOKENS:
                finish[i] = "length"
        generator.remove(set(finish))
    generator.remove(set(range(len(params))))
    return [(tokens[i][:-1] if finish[i] == "eos" else tokens[i], finish[i]) for i in range(len(params))]


def check(kind: str, spec: str, text: str, finish: str, tokens: list[int], grammar: str, generator) -> None:
    if finish == "length":  # cut short: what came must still be a prefix the grammar takes
        matcher = generator.grammars.matcher(grammar)
        assert all(matcher.consume_token(t) for t in tokens) and not matcher.is_error()
        return
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec))
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        assert text in json.loads(spec), (spec, text)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(constraints, min_size=BATCH, max_size=BATCH), st.sampled_from([0.0, 0.8, 1.5]))
def test_every_output_parses_and_validates_or_is_a_prefix_cut_at_max_tokens(generator, batch, temperature):
    grammars = [grammar_for(kind, spec, "test") for kind, spec in batch]
    params = [SamplingParams(temperature=temperature, grammar=g) for g in grammars]
    tokenizer = generator.engine.loaded.tokenizer
    for (kind, spec), grammar, (tokens, finish) in zip(batch, grammars, run(generator, params)):
        check(kind, spec, tokenizer.decode(tokens), finish, tokens, grammar, generator)


def test_most_outputs_complete_within_max_tokens(generator):
    """The fuzz above must not pass by running out of tokens: simple constraints finish."""
    batch = [("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                         "required": ["ok"], "additionalProperties": False})),
             ("regex", r"[0-9]{3}"), ("choice", '["left", "right"]'), ("json_schema", '{"enum": [1, 2]}')] * 2
    params = [SamplingParams(temperature=1.0, grammar=grammar_for(k, s, "test")) for k, s in batch]
    results = run(generator, params)
    assert [finish for _, finish in results] == ["eos"] * len(batch)
    tokenizer = generator.engine.loaded.tokenizer
    for (kind, spec), (tokens, finish) in zip(batch, results):
        check(kind, spec, tokenizer.decode(tokens), finish, tokens, "", generator)


def test_a_constrained_row_leaves_its_neighbours_alone(generator):
    greedy = SamplingParams(temperature=0.0)
    constrained = SamplingParams(temperature=0.0, grammar=grammar_for("regex", "[0-9]{4}", "test"))
    prompts = [[464, 3290], [464, 3291], [464, 3292]]
    alone = run(generator, [greedy, greedy], [prompts[0], prompts[2]])
    mixed = run(generator, [greedy, constrained, greedy], prompts)
    assert [mixed[0], mixed[2]] == alone
    assert re.fullmatch("[0-9]{4}", generator.engine.loaded.tokenizer.decode(mixed[1][0]))


@pytest.mark.parametrize(("kind", "spec", "says"), [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}', "llguidance"),
    ("json_schema", "{not json", "llguidance"),
    ("regex", "[0-9", "unclosed character class"),
    ("grammar", "start: foo", "llguidance"),
    ("choice", "[]", "non-empty"),
])
def test_a_constraint_that_does_not_compile_is_refused_quoting_llguidance(kind, spec, says):
    with pytest.raises(InvalidArgument) as refused:
        grammar_for(kind, spec, "response_format")
    assert says in refused.value.message and refused.value.param == "response_format"
    assert refused.value.message.startswith("response_format: ")


def test_the_mask_is_applied_after_the_bias(generator):
    """A bias of +100 on a token the grammar forbids does not bring it back."""
    grammar = grammar_for("regex", "[0-9]{2}", "test")
    params = [SamplingParams(temperature=0.0, logit_bias=((64, 100.0),), grammar=grammar)]  # 64: "a"
    (tokens, finish), = run(generator, params)
    assert finish == "eos" and re.fullmatch("[0-9]{2}", generator.engine.loaded.tokenizer.decode(tokens))
    assert torch.tensor(tokens).ne(64).all()
