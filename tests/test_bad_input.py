"""Every bad input gets a clear error with the right status, and the server keeps answering."""

from __future__ import annotations

import grpc
import httpx
import pytest

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
    assert response.status_code == 422
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
