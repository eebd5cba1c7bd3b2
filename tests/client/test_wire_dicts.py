"""The hand-written to_dict of the types REST answers with equals dataclasses.asdict, which it
replaces on the hot path (asdict's deep copy was half of a REST call's transport CPU): any value
of every field, nested layers, steps and prompt scores included, gives the same JSON. And the
next-token routes' answers, encoded by orjson straight from the dataclasses, are the bytes
their to_dict gives."""

from __future__ import annotations

import json
from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from gpt2serve_client.generation import GenerateChunk, GeneratedToken
from gpt2serve.transport.sse import dataclass_json, json_bytes
from gpt2serve_client.types import NextTokenResult, Timings, TokenLogprob


def same_json(obj) -> None:
    assert json.dumps(obj.to_dict()) == json.dumps(asdict(obj))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.from_type(NextTokenResult))
def test_a_next_token_result(result):
    same_json(result)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.from_type(NextTokenResult), min_size=1, max_size=3))
def test_next_token_answers_encoded_from_the_dataclasses_are_their_to_dicts(results):
    assert dataclass_json(results[0], results[0].to_dict) == json_bytes(results[0].to_dict())
    assert (dataclass_json({"results": results}, lambda: {"results": [r.to_dict() for r in results]})
            == json_bytes({"results": [r.to_dict() for r in results]}))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.from_type(GenerateChunk))
def test_a_generate_chunk(chunk):
    same_json(chunk)


def test_the_common_shapes():
    token = GeneratedToken(464, " The", -1.5, [TokenLogprob(464, " The", -1.5), TokenLogprob(1, "\"", -2.0)])
    for obj in (TokenLogprob(1, "a", -0.5), Timings(1.0, 2.0, 3.0), token,
                GenerateChunk(" The", token), GenerateChunk(" The cat", token, more_tokens=[token, token]),
                NextTokenResult(464, " The", -1.5, [TokenLogprob(464, " The", -1.5)], [1, 2], Timings(1, 2, 3))):
        same_json(obj)
