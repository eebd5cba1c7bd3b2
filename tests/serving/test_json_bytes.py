"""transport.sse.json_bytes, the encoder of REST answers and stream events: what it writes
parses back to the payload, a non-finite float becomes null (valid JSON, where the json module
wrote NaN), and what orjson refuses still goes out through the json module."""

from __future__ import annotations

import json
import math

from gpt2serve.transport.sse import json_bytes, sse_event


def test_it_round_trips_text_numbers_and_nesting():
    payload = {"token": " caf\u00e9 \ufffd\u4e2d", "logprob": -10.18527889251709, "ids": [1, 2, 3],
               "nested": {"timings": {"total_ms": 1e-5}, "empty": [], "none": None, "flag": True}}
    assert json.loads(json_bytes(payload)) == payload


def test_a_non_finite_float_is_null():
    assert json.loads(json_bytes({"logprob": -math.inf, "nan": math.nan})) == {"logprob": None, "nan": None}


def test_what_orjson_refuses_the_json_module_writes():
    big = 2**70  # past orjson's 64-bit integers
    assert json.loads(json_bytes({"n": big})) == {"n": big}


def test_an_event_is_data_then_a_blank_line():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse_event({"a": 1}, event="error") == b'event: error\ndata: {"a":1}\n\n'
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
