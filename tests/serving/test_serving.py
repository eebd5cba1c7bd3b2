"""A real server process answered by all three real clients, checked against transformers."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from support.reference import assert_matches_reference

from gpt2serve_client import AsyncClient, Client, RestClient

PROMPTS = [
    "The capital of France is",
    "Hello",
    "In 1905 Albert Einstein published four papers that changed physics, and",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.grpc_target) as client:
        yield client


@pytest.fixture(scope="module")
def rest_client(server):
    with RestClient(server.http_url) as client:
        yield client


@pytest.fixture(scope="module")
def ask(server, grpc_client, rest_client):
    """ask(kind, method, *args): call one client method through the "grpc", "async" or "rest" client."""

    def call(kind: str, method: str, *args, **kwargs):
        if kind == "async":
            async def main():
                async with AsyncClient(server.grpc_target) as client:
                    return await getattr(client, method)(*args, **kwargs)

            return asyncio.run(main())
        return getattr({"grpc": grpc_client, "rest": rest_client}[kind], method)(*args, **kwargs)

    return call


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_next_token_matches_transformers(kind, ask, tiny_model, tokenizer):
    for prompt, k in zip(PROMPTS, [5, 1, 10, 3]):
        result = ask(kind, "next_token", prompt, top_k=k)
        ids = tokenizer.encode(prompt)
        assert_matches_reference(tiny_model.model, result, ids, k)
        assert result.token == tokenizer.token_text(result.token_id)
        assert [t.token for t in result.top] == [tokenizer.token_text(t.token_id) for t in result.top]
        assert result.trace_id == ""
        assert result.timings.total_ms >= result.timings.forward_ms > 0


def test_real_token_ids_of_the_example_prompt(grpc_client):
    assert grpc_client.next_token("The capital of France is").prompt_token_ids == [464, 3139, 286, 4881, 318]


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_token_id_prompts(kind, ask, tiny_model):
    ids = [50256, 464, 3139, 11, 0, 50255]
    result = ask(kind, "next_token", ids, top_k=4)
    assert_matches_reference(tiny_model.model, result, ids, 4)


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_batch_of_different_lengths_matches_each_alone(kind, ask, tiny_model, tokenizer):
    prompts = [*PROMPTS, [464, 3139]]
    results = ask(kind, "next_token_batch", prompts, top_k=6)
    assert len(results) == len(prompts)
    for prompt, result in zip(prompts, results):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert_matches_reference(tiny_model.model, result, ids, 6)
    # All prompts of one call share a forward pass (the queue takes them together).
    assert all(r.batch_size == len(prompts) for r in results)


def test_many_concurrent_single_requests(server, tiny_model, tokenizer):
    prompts = [f"Request number {i} asks about {'cats ' * (i % 7)}" for i in range(48)]

    async def main():
        async with AsyncClient(server.grpc_target) as client:
            return await asyncio.gather(*(client.next_token(p, top_k=3) for p in prompts))

    results = asyncio.run(main())
    for prompt, result in zip(prompts, results):
        assert_matches_reference(tiny_model.model, result, tokenizer.encode(prompt), 3)
    assert max(r.batch_size for r in results) > 1, "concurrent requests were never batched"


def test_concurrent_rest_and_grpc_threads(server, tiny_model, tokenizer):
    prompts = [f"Thread {i} says hello to" for i in range(16)]

    def ask(i: int):
        if i % 2:
            with RestClient(server.http_url) as client:
                return client.next_token(prompts[i], top_k=2)
        with Client(server.grpc_target) as client:
            return client.next_token(prompts[i], top_k=2)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(prompts))))
    for prompt, result in zip(prompts, results):
        assert_matches_reference(tiny_model.model, result, tokenizer.encode(prompt), 2)


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_model_info(kind, ask, tiny_model):
    info = ask(kind, "model_info")
    model = tiny_model.model
    assert (info.model, info.weights, info.dtype, info.device) == ("random:tiny", "random", "float32", "cpu")
    assert info.weights_source == "random:tiny (seed 0)"
    a = info.architecture
    assert (a.n_layer, a.n_head, a.d_model, a.d_head, a.d_mlp, a.n_ctx, a.vocab_size) == (2, 4, 64, 16, 256, 256, 50257)
    p = info.parameters
    parts = [p.token_embedding, p.position_embedding, p.attention_qkv, p.attention_output, p.mlp, p.layer_norm, p.lm_head]
    assert sum(parts) == p.total == sum(t.numel() for t in model.parameters())
    assert info.max_prompt_tokens == 256 and info.max_batch_size == 64


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_health(kind, ask):
    health = ask(kind, "health")
    assert health.serving and health.status == "SERVING"


@pytest.mark.parametrize("kind", ["grpc", "async", "rest"])
def test_attention_maps_over_the_wire(kind, ask, tiny_model, tokenizer):
    from support.reference import reference_maps

    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    result = ask(kind, "next_token", prompt, top_k=3, attention_maps=True)
    cfg = tiny_model.model.config
    assert len(result.layers) == cfg.n_layer  # attention_maps implies include_layers
    for report, want in zip(result.layers, reference_maps(tiny_model.model, ids)):
        assert report.attn_shape == [cfg.n_head, len(ids), len(ids)]
        for head in range(cfg.n_head):
            for got_row, want_row in zip(report.attention_map(head), want["attention"][head].tolist()):
                assert got_row == pytest.approx(want_row, abs=1e-5)
        assert [t.token_id for t in report.logit_lens_positions] == want["lens_ids"]
        assert [t.token for t in report.logit_lens_positions] == [tokenizer.token_text(i) for i in want["lens_ids"]]


@pytest.mark.parametrize("kind", ["grpc", "rest"])
def test_attention_maps_are_bounded_to_128_tokens(kind, ask):
    from gpt2serve_client import Gpt2ServeError

    assert len(ask(kind, "next_token", list(range(1, 129)), top_k=1, attention_maps=True).layers) == 2
    with pytest.raises(Gpt2ServeError) as error:
        ask(kind, "next_token", list(range(1, 130)), top_k=1, attention_maps=True)
    assert error.value.code == "INVALID_ARGUMENT" and "at most 128 tokens" in error.value.message
    if kind == "rest":
        assert error.value.http_status == 400
