"""Property-based fuzzing of both transports: whatever a client sends, the answer is a result or
a clear client error (never a 5xx / INTERNAL), and the server keeps answering correctly.

Examples are derandomized so CI is reproducible; over 2,000 requests run in all (checked last).
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reference import assert_matches_reference

from gpt2serve_client import Client
from gpt2serve_client._proto import gpt2serve_pb2 as pb

# A fixed amount of work: on a loaded machine it takes longer, and pyproject's 300 s (set to catch a
# hang) is not a speed limit.
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(1800)]

SENT = {"rest": 0, "grpc": 0}
FUZZ = settings(max_examples=600, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
REST_OK = {200, 400, 413, 422, 429}
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}
INT32 = st.integers(-2**31, 2**31 - 1)

huge_text = st.builds(lambda c, n: c * n, st.characters(), st.integers(0, 300_000))
texts = st.one_of(st.text(), st.text(alphabet=st.characters(codec="utf-8"), max_size=2000), huge_text)
token_ids = st.lists(st.one_of(st.integers(0, 50256), INT32), max_size=400)
# Any JSON value, for "wrong type" cases.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
prompt_values = st.one_of(texts, token_ids, json_values)
top_ks = st.one_of(st.none(), st.integers(-10, 60000), st.integers(), json_values)
flags = st.one_of(st.booleans(), json_values)

prompt_logprobs = st.one_of(st.none(), st.integers(-5, 25), st.integers(), json_values)
rest_bodies = st.fixed_dictionaries({}, optional={
    "prompt": prompt_values, "prompt_token_ids": prompt_values, "top_k": top_ks,
    "trace_layers": flags, "include_layers": flags, "unknown": json_values, "prompt_logprobs": prompt_logprobs,
})
rest_batch_bodies = st.fixed_dictionaries({}, optional={
    "prompts": st.one_of(st.lists(st.one_of(texts, token_ids, json_values), max_size=70), json_values),
    "top_k": top_ks, "include_layers": flags, "prompt_logprobs": prompt_logprobs,
})


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def raw_grpc(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield {name: channel.unary_unary(f"/gpt2serve.v1.Gpt2Serve/{name}")  # raw bytes in, raw bytes out
               for name in ("NextToken", "NextTokenBatch")}


MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the server's default --max-message-bytes


def post(http, path: str, content: bytes) -> None:
    SENT["rest"] += 1
    try:
        response = http.post(path, content=content, headers={"content-type": "application/json"})
    except httpx.RemoteProtocolError:
        # Over the limit, the server answers 413 at once and closes without reading the body;
        # a client still sending may see the close before the answer. Only then is this fine.
        assert len(content) > MAX_MESSAGE_BYTES, len(content)
        return
    assert response.status_code in REST_OK, (response.status_code, response.text[:500], content[:300])
    if response.status_code != 200:
        assert response.json()["error"]["message"]


@FUZZ
@given(body=rest_bodies)
def test_rest_next_token_bodies(http, body):
    post(http, "/v1/next-token", json.dumps(body).encode())  # ensure_ascii: lone surrogates as \\udXXX


@FUZZ
@given(body=rest_batch_bodies)
def test_rest_batch_bodies(http, body):
    post(http, "/v1/next-token/batch", json.dumps(body).encode())


@settings(FUZZ, max_examples=200)
@given(content=st.one_of(st.binary(max_size=3000), st.text().map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_rest_raw_bytes(http, content):
    post(http, "/v1/next-token", content)


def call(raw_grpc, method: str, payload: bytes) -> None:
    SENT["grpc"] += 1
    try:
        raw_grpc[method](payload, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() in GRPC_OK, (exc.code(), exc.details(), payload[:300])
        assert exc.details()


grpc_prompts = st.builds(pb.Prompt, prompt=texts, prompt_token_ids=st.lists(INT32, max_size=400))


@FUZZ
@given(prompt=texts, ids=st.lists(INT32, max_size=400), top_k=st.one_of(st.none(), INT32),
       trace=st.booleans(), include=st.booleans(), scored=st.one_of(st.none(), st.integers(-3, 25), INT32))
def test_grpc_next_token_messages(raw_grpc, prompt, ids, top_k, trace, include, scored):
    request = pb.NextTokenRequest(prompt=prompt, prompt_token_ids=ids, top_k=top_k, trace_layers=trace,
                                  include_layers=include, prompt_logprobs=scored)
    call(raw_grpc, "NextToken", request.SerializeToString())


@settings(FUZZ, max_examples=300)
@given(prompts=st.lists(grpc_prompts, max_size=70), top_k=st.one_of(st.none(), INT32),
       scored=st.one_of(st.none(), st.integers(-3, 25), INT32))
def test_grpc_batch_messages(raw_grpc, prompts, top_k, scored):
    call(raw_grpc, "NextTokenBatch", pb.NextTokenBatchRequest(prompts=prompts, top_k=top_k,
                                                              prompt_logprobs=scored).SerializeToString())


@settings(FUZZ, max_examples=300)
@given(payload=st.one_of(
    st.binary(max_size=2000),
    # Valid framing, invalid UTF-8 in the prompt field.
    st.binary(min_size=1, max_size=100).map(lambda b: b"\x0a" + bytes([len(b)]) + b),
))
def test_grpc_raw_bytes(raw_grpc, payload):
    call(raw_grpc, "NextToken", payload)


def test_over_2000_cases_and_the_server_still_answers_correctly(server, tiny_model):
    assert SENT["rest"] + SENT["grpc"] >= 2000, SENT
    assert server.proc.poll() is None
    with Client(server.grpc_target) as client:
        assert_matches_reference(tiny_model.model, client.next_token([464, 3139, 286], top_k=4), [464, 3139, 286], 4)
    assert httpx.get(f"{server.http_url}/readyz").status_code == 200
