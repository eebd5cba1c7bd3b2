"""Tokenize and detokenize on REST (vLLM's /tokenize and /detokenize shapes), gRPC, every client
and the CLI, with the chat template applied when asked; and `--served-model-name`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.servers import launch_server, metric_value

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError, RestClient

CHATML = (Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja").read_text()
TEXT = "The capital of France is Paris, naïvely 🙂"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("tokenize"), "--model", "random:tiny", "--chat-template", CHATML,
                        "--served-model-name", "my-gpt2", "--max-prompt-tokens", "200")
    yield srv
    srv.stop()


def test_every_client_tokenizes_as_the_tokenizer_does(named, tokenizer):
    expected = tokenizer.encode(TEXT)
    with Client(named.grpc_target) as grpc_client, RestClient(named.http_url) as rest:
        for result in (grpc_client.tokenize(TEXT, return_token_strs=True), rest.tokenize(TEXT, return_token_strs=True),
                       asyncio.run(async_tokenize(named.grpc_target))):
            assert result.tokens == expected and result.count == len(expected) and result.max_model_len == 200
            assert result.token_strs == [tokenizer.token_text(t) for t in expected]
            assert grpc_client.detokenize(result.tokens) == rest.detokenize(result.tokens) == TEXT
        # Longer than the server takes as a prompt: still counted (that is what tokenize is for).
        long = grpc_client.tokenize(" word" * 600)
        assert long.count == 600 > long.max_model_len
        assert grpc_client.tokenize("").tokens == []


async def async_tokenize(target: str):
    async with AsyncClient(target) as client:
        result = await client.tokenize(TEXT, return_token_strs=True)
        assert await client.detokenize(result.tokens) == TEXT
        return result


def test_vllm_shapes_on_rest(named, tokenizer):
    body = httpx.post(f"{named.http_url}/tokenize", json={"model": "my-gpt2", "prompt": "Hello world",
                                                          "add_special_tokens": True}).json()
    assert body == {"count": 2, "max_model_len": 200, "tokens": tokenizer.encode("Hello world"), "token_strs": None}
    assert httpx.post(f"{named.http_url}/v1/tokenize", json={"prompt": "Hello world"}).json()["tokens"] == body["tokens"]
    assert httpx.post(f"{named.http_url}/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    wrong_model = httpx.post(f"{named.http_url}/tokenize", json={"model": "gpt2", "prompt": "x"})
    assert wrong_model.status_code == 404 and "my-gpt2" in wrong_model.json()["error"]["message"]
    out_of_vocab = httpx.post(f"{named.http_url}/detokenize", json={"tokens": [1, 99999999]})
    assert out_of_vocab.status_code == 400 and "outside the vocabulary" in out_of_vocab.json()["error"]["message"]
    typo = httpx.post(f"{named.http_url}/tokenize", json={"promt": "x"})
    assert typo.status_code == 422 and "promt" in typo.json()["error"]["message"]
    assert metric_value(named.http_url, "gpt2serve_requests_total",
                        {"api": "rest", "method": "Detokenize", "status": "INVALID_ARGUMENT"}) >= 1


def test_a_conversation_is_tokenized_through_the_chat_template(named, tokenizer):
    with Client(named.grpc_target) as client, RestClient(named.http_url) as rest:
        opened = client.tokenize(messages=CONVERSATION)
        closed = rest.tokenize(messages=CONVERSATION, add_generation_prompt=False)
        assert rest.tokenize(messages=CONVERSATION).tokens == opened.tokens
    # examples/chat-templates/chatml.jinja: each turn ends with GPT-2's end-of-text token.
    rendered = "<|im_start|>system\nBe brief.<|endoftext|>\n<|im_start|>user\nCapital of France?<|endoftext|>\n"
    assert closed.tokens == tokenizer.encode(rendered)
    assert opened.tokens == tokenizer.encode(rendered + "<|im_start|>assistant\n")
    # The same tokens a chat completion's prompt is made of: its usage counts them.
    chat = httpx.post(f"{named.http_url}/v1/chat/completions",
                      json={"model": "my-gpt2", "messages": CONVERSATION, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == opened.count and chat["model"] == "my-gpt2"
    with Client(named.grpc_target) as client, pytest.raises(Gpt2ServeError) as refused:
        client.tokenize(messages=[{"role": "wizard", "content": "hi"}])
    assert refused.value.code == "INVALID_ARGUMENT" and "wizard" in refused.value.message


def test_the_served_model_name_is_used_everywhere(named):
    assert [m["id"] for m in httpx.get(f"{named.http_url}/v1/models").json()["data"]] == ["my-gpt2"]
    with Client(named.grpc_target) as client:
        assert client.model_info().model == "my-gpt2"
    completion = httpx.post(f"{named.http_url}/v1/completions", json={"model": "my-gpt2", "prompt": "Hi", "max_tokens": 1})
    assert completion.status_code == 200 and completion.json()["model"] == "my-gpt2"
    assert httpx.post(f"{named.http_url}/v1/completions",
                      json={"model": "random:tiny", "prompt": "Hi", "max_tokens": 1}).status_code == 404
    assert metric_value(named.http_url, "gpt2serve_model_info", {"model": "my-gpt2", "dtype": "float32",
                                                                 "device": "cpu", "weights": "random"}) == 1


def test_the_cli_tokenizes(named, tokenizer):
    out = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "tokenize", "Hello world", "--strs",
                          "--target", named.grpc_target], capture_output=True, text=True, timeout=60,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    ids = tokenizer.encode("Hello world")
    assert out.stdout.splitlines()[0] == f"2 tokens (this server takes prompts of up to 200): {ids}"
    assert out.stdout.splitlines()[2].split() == [str(ids[1]), "'␣world'"]
