"""Per-step traces of a generation (trace_steps) through REST and gRPC, checked against
transformers' own eager attention for every step's sequence; off by default; their limits."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import httpx
import pytest
import torch
from support.servers import launch_server
from support.reference import reference_logits, reference_logprobs, reference_maps

from gpt2serve.engine.constraints import Grammars, allowed
from gpt2serve.engine.grammar_check import grammar_for
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


def test_a_controlled_step_shows_its_top_tokens_before_and_after_the_controls(server, tiny_model):
    """With penalties and a bias, each step's `controlled_top` is the reference model's logits
    after them, by the formulas (bias; repetition over prompt and output; presence over the
    output), and greedy picks its first; `top` stays the model's own. Nothing masks: every
    token is left possible."""
    raw_best = int(reference_logits(tiny_model.model, PROMPT).argmax())
    controls = {"repetition_penalty": 1.5, "presence_penalty": 0.75, "logit_bias": {str(raw_best): -100}}
    data = generate(server, max_tokens=5, temperature=0, ignore_eos=True, trace_steps=True, **controls)
    tokens = [t["token_id"] for t in data["tokens"]]
    assert tokens[0] != raw_best  # the bias moved the choice
    for i, step in enumerate(data["steps"]):
        sequence, output = PROMPT + tokens[:i], tokens[:i]
        logits = reference_logits(tiny_model.model, sequence)
        assert [t["token_id"] for t in step["top"]] == torch.log_softmax(logits, -1).topk(5).indices.tolist()
        logits[raw_best] -= 100
        seen = torch.tensor(sorted(set(sequence)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.5, logits[seen] * 1.5)
        if output:
            logits[torch.tensor(sorted(set(output)))] -= 0.75
        want = torch.log_softmax(logits, -1).topk(5)
        assert [t["token_id"] for t in step["controlled_top"]] == want.indices.tolist()
        assert [t["logprob"] for t in step["controlled_top"]] == pytest.approx(want.values.tolist(), abs=TOLERANCE)
        assert step["controlled_top"][0]["token_id"] == tokens[i]  # greedy over the controlled logits
        assert step["allowed_tokens"] == tiny_model.model.config.vocab_size
    plain = generate(server, max_tokens=2, temperature=0, trace_steps=True)
    assert all(s["controlled_top"] == [] and s["allowed_tokens"] == 0 for s in plain["steps"])


def allowed_by_choices(tokenizer, choices: list[str], text: str) -> set[int]:
    """Brute force over the vocabulary: the tokens that keep `text` a prefix of some choice, or
    end of text once it is one. llguidance allows a subset: not a token that splits one it
    would rather take whole (after "y", "es" but not "e")."""
    done = text.encode()
    wanted = [c.encode() for c in choices if c.encode().startswith(done)]
    allowed = {t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t)
               and any(w.startswith(done + tokenizer.token_bytes(t)) for w in wanted)}
    return allowed | ({tokenizer.eos_token_id} if done in wanted else set())


def allowed_by_llguidance(tokenizer, choices: list[str], tokens: list[int]) -> set[int]:
    """What the library itself allows after `tokens`, asked directly."""
    matcher = Grammars(tokenizer).matcher(grammar_for("choice", json.dumps(choices), "choice"))
    assert matcher.consume_tokens(tokens)
    (mask,), _ = allowed([matcher], tokenizer.vocab_size, torch.device("cpu"))
    return set(mask.nonzero()[:, 0].tolist())


@pytest.mark.parametrize("api", ["rest", "grpc"])
def test_a_constrained_step_shows_what_its_grammar_allowed(server, tokenizer, api):
    """Under a choice, each step's `allowed_tokens` is how many tokens llguidance allows there,
    all of which keep the text on a choice (checked by brute force over the vocabulary), and its
    top tokens after the controls are all among them. (The step that chose the end of text, like any end token, has
    no step trace: its count is in the span, tests/observability/test_tracing.py.)"""
    choices = ["yes please", "no thanks"]
    if api == "rest":
        data = generate(server, max_tokens=12, temperature=0.7, seed=4, structured_outputs={"choice": choices},
                        trace_steps=True)
        text, steps = data["text"], data["steps"]
        tokens = [t["token_id"] for t in data["tokens"]]
    else:
        with Client(server.grpc_target) as client:
            result = client.generate(PROMPT, max_tokens=12, temperature=0.7, seed=4, choice=choices, trace_steps=True)
        text, steps = result.text, [asdict(s) for s in result.steps]
        tokens = [t.token_id for t in result.tokens]
    assert text in choices and len(steps) == len(tokens)
    for i, step in enumerate(steps):
        allowed = allowed_by_llguidance(tokenizer, choices, tokens[:i])
        assert tokens[i] in allowed <= allowed_by_choices(tokenizer, choices, tokenizer.decode(tokens[:i]))
        assert step["allowed_tokens"] == len(allowed)
        assert {t["token_id"] for t in step["controlled_top"]} <= allowed
        assert len(step["controlled_top"]) == min(5, len(allowed))
        assert sum(math.exp(t["logprob"]) for t in step["controlled_top"]) <= 1.0 + 1e-5
    assert steps[0]["allowed_tokens"] > 2  # "y", "ye", "yes", "n", "no"
