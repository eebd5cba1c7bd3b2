"""Per-step traces of a generation (trace_steps) through REST and gRPC, checked against
transformers' own eager attention for every step's sequence; off by default; their limits."""

from __future__ import annotations

import httpx
import pytest
from support.servers import launch_server
from support.reference import reference_logprobs, reference_maps

from gpt2serve_client import Client
from gpt2serve_client.errors import Gpt2ServeError

PROMPT = [464, 3139, 286, 4881, 318]  # "The capital of France is"
TOLERANCE = 1e-4


def generate(server, **body) -> dict:
    response = httpx.post(f"{server.http_url}/v1/generate", json={"prompt_token_ids": PROMPT, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_each_step_is_what_the_model_computed_for_its_sequence(server, tiny_model, tokenizer):
    data = generate(server, max_tokens=5, temperature=0, ignore_eos=True, trace_steps=True)
    cfg = tiny_model.model.config
    tokens = [t["token_id"] for t in data["tokens"]]
    assert len(data["steps"]) == len(tokens) == 5
    context = []
    for i, step in enumerate(data["steps"]):
        sequence = PROMPT + tokens[:i]
        L = len(sequence)
        assert (step["index"], step["position"], step["context_tokens"]) == (i, L - 1, L)
        assert step["new_row_shape"] == ([len(PROMPT), cfg.d_model] if i == 0 else [1, cfg.d_model])
        assert step["kv_cache_shape"] == [cfg.n_head, L, cfg.d_head]
        assert (step["n_layer"], step["n_head"]) == (cfg.n_layer, cfg.n_head)
        assert step["token_id"] == tokens[i] and step["token"] == tokenizer.token_text(tokens[i])
        context += step["new_tokens"]
        assert context == [tokenizer.token_text(t) for t in sequence]  # the steps so far spell the sequence
        # transformers' eager attention of the same sequence: its last row is the new row's attention
        maps = reference_maps(tiny_model.model, sequence)
        assert len(step["attention"]) == cfg.n_layer * cfg.n_head * L
        for layer, want in enumerate(maps):
            for head in range(cfg.n_head):
                start = (layer * cfg.n_head + head) * L
                got = step["attention"][start:start + L]
                assert got == pytest.approx(want["attention"][head, -1].tolist(), abs=TOLERANCE)
                assert sum(got) == pytest.approx(1.0, abs=1e-4)
            assert step["logit_lens"][layer]["token_id"] == want["lens_ids"][-1]
        reference = reference_logprobs(tiny_model.model, sequence)
        assert [t["token_id"] for t in step["top"]] == reference.topk(5).indices.tolist()
        assert step["top"][0]["token_id"] == tokens[i]  # greedy: the chosen token is the best one
        shapes = {s["name"]: s["shape"] for s in step["walkthrough"]}
        if i == 0:  # the prefill: the prompt's whole forward
            assert shapes["Q per head"] == [1, cfg.n_head, L, cfg.d_head] and shapes["logits"] == [1, cfg.vocab_size]
        else:  # a decode step: one row over the cache
            assert shapes["Q per head"] == [1, cfg.n_head, 1, cfg.d_head]
            assert shapes["K cache per head"] == shapes["V cache per head"] == [1, cfg.n_head, L, cfg.d_head]
            assert shapes["attention row: softmax(QKᵀ / √d_head)"] == [1, cfg.n_head, 1, L]


def test_grpc_streams_a_step_with_each_token_in_order(server):
    with Client(server.grpc_target) as client:
        chunks = list(client.generate_stream(PROMPT, max_tokens=4, temperature=0.8, seed=3, ignore_eos=True,
                                             trace_steps=True))
        plain = client.generate(PROMPT, max_tokens=4, temperature=0.8, seed=3, ignore_eos=True)
        traced = client.generate(PROMPT, max_tokens=4, temperature=0.8, seed=3, ignore_eos=True, trace_steps=True)
    tokens = [c for c in chunks if c.token is not None]
    assert [c.step.index for c in tokens] == [0, 1, 2, 3]
    assert all(c.step.token_id == c.token.token_id for c in tokens)
    assert chunks[-1].token is None and chunks[-1].step is None and chunks[-1].finish_reason == "length"
    # tracing changes nothing of the generation itself
    assert [t.token_id for t in traced.tokens] == [t.token_id for t in plain.tokens] == [c.token.token_id for c in tokens]
    assert len(traced.steps) == 4 and plain.steps == []
    step = traced.steps[2]
    L = step.context_tokens
    assert L == len(PROMPT) + 2 and step.attention_row(1, 0) == step.attention[step.n_head * L:step.n_head * L + L]


def test_steps_are_off_by_default(server):
    data = generate(server, max_tokens=3, temperature=0)
    assert data["steps"] == [] and len(data["tokens"]) >= 1
    events = httpx.post(f"{server.http_url}/v1/generate", json={"prompt_token_ids": PROMPT, "max_tokens": 2,
                                                               "stream": True}, timeout=60).text
    assert '"step":null' in events and '"step":{' not in events


def test_a_traced_generation_must_fit_128_tokens(server):
    response = httpx.post(f"{server.http_url}/v1/generate", json={"prompt_token_ids": PROMPT, "max_tokens": 124,
                                                                 "trace_steps": True}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and "exceed the 128 tokens a traced generation may hold" in error["message"]
    with Client(server.grpc_target) as client, pytest.raises(Gpt2ServeError) as raised:
        client.generate(PROMPT, max_tokens=124, trace_steps=True)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert generate(server, max_tokens=123, trace_steps=False)["usage"]["completion_tokens"] >= 1  # untraced: fine


@pytest.mark.slow
def test_trace_layers_never_refuses_step_traces(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--trace-layers", "never")
    try:
        response = httpx.post(f"{srv.http_url}/v1/generate", json={"prompt_token_ids": PROMPT, "max_tokens": 2,
                                                                  "trace_steps": True}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "FAILED_PRECONDITION"
        assert "--trace-layers never" in response.json()["error"]["message"]
        ok = httpx.post(f"{srv.http_url}/v1/generate", json={"prompt_token_ids": PROMPT, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        srv.stop()
