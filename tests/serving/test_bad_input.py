"""Every bad input gets a clear error with the right status, and the server keeps answering."""

from __future__ import annotations

import grpc
import httpx
import pytest
from support.servers import launch_server, requests_total

from gpt2serve_client import Client, Gpt2ServeError, RestClient
from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc

VOCAB = 50257
N_CTX = 256  # random:tiny

# (request fields, words the message must contain); the same cases over gRPC and REST.
BAD_NEXT_TOKEN = [
    ({"prompt": ""}, "empty"),
    ({}, "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "not both"),
    ({"prompt": "hello " * (N_CTX + 1)}, "exceed the limit of 256"),
    ({"prompt_token_ids": [1] * (N_CTX + 1)}, "257 tokens exceed"),
    ({"prompt_token_ids": [464, VOCAB]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt": "hi", "top_k": 0}, "top_k"),
    ({"prompt": "hi", "top_k": -3}, "top_k"),
    ({"prompt": "hi", "top_k": VOCAB + 1}, "top_k"),
]


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.Gpt2ServeStub(channel)


@pytest.mark.parametrize("fields, words", BAD_NEXT_TOKEN)
def test_grpc_next_token_invalid_argument(stub, fields, words):
    with pytest.raises(grpc.RpcError) as info:
        stub.NextToken(pb.NextTokenRequest(**fields), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


@pytest.mark.parametrize("fields, words", BAD_NEXT_TOKEN)
def test_rest_next_token_400(server, fields, words):
    response = httpx.post(f"{server.http_url}/v1/next-token", json=fields, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and words in error["message"]


def test_grpc_batch_limits(stub):
    cases = [
        (pb.NextTokenBatchRequest(), "at least one prompt"),
        (pb.NextTokenBatchRequest(prompts=[pb.Prompt(prompt="x")] * 65), "65 prompts exceed the limit of 64"),
        (pb.NextTokenBatchRequest(prompts=[pb.Prompt(prompt="ok"), pb.Prompt(prompt="")]), "prompts[1]"),
        (pb.NextTokenBatchRequest(prompts=[pb.Prompt(prompt_token_ids=[VOCAB + 7])]), "outside the vocabulary"),
    ]
    for request, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.NextTokenBatch(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details()


@pytest.mark.parametrize("body, status, words", [
    ({"prompts": []}, 400, "at least one prompt"),
    ({"prompts": ["x"] * 65}, 400, "65 prompts exceed"),
    ({"prompts": ["fine", ""]}, 400, "prompts[1]"),
    ({"prompts": "not a list"}, 422, "prompts"),
    ({"prompts": [1.5]}, 422, "prompts"),
    ({}, 422, "prompts"),
])
def test_rest_batch_errors(server, body, status, words):
    response = httpx.post(f"{server.http_url}/v1/next-token/batch", json=body, timeout=10)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


@pytest.mark.parametrize("content, words", [
    (b"{not json", "JSON"),
    (b"[1, 2]", "body"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "hi", "top_k": "5"}', "top_k"),
    (b'{"prompt": "hi", "top_k": 2.5}', "top_k"),
    (b'{"prompt_token_ids": ["a"]}', "prompt_token_ids"),
    (b'{"prompt": "hi", "trace_layers": "yes"}', "trace_layers"),
    (b'{"prompt": "hi", "topk": 3}', "topk"),
    (b'"just a string"', "body"),
])
def test_rest_malformed_json_and_wrong_types_are_422(server, content, words):
    response = httpx.post(f"{server.http_url}/v1/next-token", content=content,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and words in error["message"]


def test_rest_without_json_content_type_says_so(server):
    response = httpx.post(f"{server.http_url}/v1/next-token", content=b'{"prompt": "hi"}', timeout=10)
    assert response.status_code == 415  # Unsupported Media Type
    assert "Content-Type: application/json" in response.json()["error"]["message"]


def test_clients_raise_typed_errors(server):
    with Client(server.grpc_target) as client, pytest.raises(Gpt2ServeError) as grpc_error:
        client.next_token("hi", top_k=0)
    with RestClient(server.http_url) as client, pytest.raises(Gpt2ServeError) as rest_error:
        client.next_token("hi", top_k=0)
    assert grpc_error.value.code == rest_error.value.code == "INVALID_ARGUMENT"
    assert rest_error.value.http_status == 400
    assert "top_k" in grpc_error.value.message and "top_k" in rest_error.value.message


def test_unreachable_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=2) as client, pytest.raises(Gpt2ServeError) as grpc_error:
        client.next_token("hi")
    with RestClient("http://127.0.0.1:1", timeout=2) as client, pytest.raises(Gpt2ServeError) as rest_error:
        client.next_token("hi")
    assert grpc_error.value.code == rest_error.value.code == "UNAVAILABLE"


def test_server_still_answers_after_bad_input(server):
    with Client(server.grpc_target) as client:
        assert client.next_token("still alive?", top_k=2).prompt_token_ids
    assert httpx.get(f"{server.http_url}/readyz").status_code == 200


def raw_next_token(server, payload: bytes, timeout: float = 10, method: str = "NextToken") -> bytes:
    """Send bytes as they are: what a broken or hostile client can put on the wire."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = channel.unary_unary(f"/gpt2serve.v1.Gpt2Serve/{method}")  # no serializers: raw bytes
        return call(payload, timeout=timeout)


def rejected_count(server, method: str, code: str, api: str = "grpc") -> float:
    return requests_total(server.http_url, api, method, code)


@pytest.mark.parametrize("payload, words", [
    (b"\x0a\x02\xff\xfe", "NextTokenRequest"),  # field 1 (prompt): invalid UTF-8
    (b"\x0a\x05ab", "NextTokenRequest"),  # truncated: says 5 bytes, carries 2
    (b"\xff\xff\xff", "NextTokenRequest"),  # not protobuf at all
])
def test_grpc_undecodable_request_is_invalid_argument_and_counted(server, payload, words):
    before = rejected_count(server, "NextToken", "INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError) as info:
        raw_next_token(server, payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert words in info.value.details()
    assert rejected_count(server, "NextToken", "INVALID_ARGUMENT") == before + 1


def test_rest_lone_surrogate_is_422_not_500(server):
    # JSON can escape a lone surrogate; UTF-8 (and so the tokenizer) cannot carry one.
    response = httpx.post(f"{server.http_url}/v1/next-token", content=b'{"prompt": "a\\ud800b"}',
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 422, response.text
    assert "hex escape" in response.json()["error"]["message"]


def test_rest_invalid_utf8_body_is_422(server):
    response = httpx.post(f"{server.http_url}/v1/next-token", content=b'{"prompt": "\xff\xfe"}',
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 422, response.text


def test_text_far_over_the_token_limit_is_refused_without_tokenizing(server):
    # 256 tokens x 128 bytes (GPT-2's longest token) = 32768 bytes can never fit random:tiny.
    with Client(server.grpc_target) as client, pytest.raises(Gpt2ServeError) as error:
        client.next_token("x" * 40000)
    assert error.value.code == "INVALID_ARGUMENT" and "whatever they encode to" in error.value.message


def test_long_text_under_the_byte_bound_is_tokenized_and_checked(server):
    # 3000 characters: tokenized in a worker thread (over the inline limit), then over 256 tokens.
    with Client(server.grpc_target) as client, pytest.raises(Gpt2ServeError) as error:
        client.next_token("hello " * 500)
    assert error.value.code == "INVALID_ARGUMENT" and "tokens exceed the limit of 256" in error.value.message


@pytest.fixture(scope="module")
def small_message_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("msg"), "--model", "random:tiny", "--max-message-bytes", "4096")
    yield srv
    srv.stop()


def test_grpc_message_over_the_limit_is_resource_exhausted(small_message_server):
    with Client(small_message_server.grpc_target, retries=0) as client:
        with pytest.raises(Gpt2ServeError) as error:
            client.next_token("a" * 5000)
        assert error.value.code == "RESOURCE_EXHAUSTED"
        assert client.next_token("a" * 100, top_k=1).token_id >= 0  # under the limit: fine


def test_rest_body_over_the_limit_is_413_by_length_and_by_chunks(small_message_server):
    url = f"{small_message_server.http_url}/v1/next-token"
    declared = httpx.post(url, json={"prompt": "a" * 5000}, timeout=10)
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["code"] == "RESOURCE_EXHAUSTED" and "4096 bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    streamed = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    assert streamed.status_code == 413, streamed.text
    assert rejected_count(small_message_server, "NextToken", "RESOURCE_EXHAUSTED", api="rest") == 2
    assert httpx.post(url, json={"prompt": "a" * 100}, timeout=10).status_code == 200
