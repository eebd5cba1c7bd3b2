"""The shape walk-through: recorded from the real forward, checked against each model's config.

gpt2-xl runs its real forward on the meta device (shapes only, no weights); tiny is served, and
its walk-through comes back through REST and gRPC for a single and a batched request."""

from __future__ import annotations

import httpx
import pytest
import torch

from gpt2serve.engine.gpt2 import GPT2
from gpt2serve.engine.loading import ARCHITECTURES
from gpt2serve.introspection.architectures import PRESETS
from gpt2serve.introspection.walkthrough import ShapeRecorder, preset_walkthrough, traced_walkthrough
from gpt2serve_client import Client
from support.walkthrough import expected

PROMPT = "The capital of France is"


def traced_on_meta(name: str, B: int, T: int):
    with torch.device("meta"):
        model = GPT2(ARCHITECTURES[name])
        recorder = ShapeRecorder()
        ids = torch.zeros(B, T, dtype=torch.long)
        hidden = model.hidden_states(ids, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.bool), recorder)
        last = hidden[:, -1]
        recorder.unembedded(last, model.lm_head(model.ln_f(last)))
    return traced_walkthrough(recorder, model), recorder


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-xl"])
@pytest.mark.parametrize("B, T", [(1, 5), (2, 4)])
def test_the_real_forwards_shapes_match_the_config(name, B, T):
    steps, recorder = traced_on_meta(name, B, T)
    config = ARCHITECTURES[name]
    want = expected(config, B, T)
    drawn = {step.name: step.shape for step in steps}
    assert {k: drawn[k] for k in want} == want
    assert recorder.n_layer == config.n_layer
    assert [s.kind for s in steps].count("weight") == 10  # wte, wpe; a block's 2 norms and 4 matrices; ln_f, lm_head
    # and the analytic walk-through of the same preset (what /ui draws without weights) agrees step by step
    assert [(s.stage, s.name, s.kind, s.shape) for s in steps] == \
        [(s.stage, s.name, s.kind, s.shape) for s in preset_walkthrough(PRESETS[name], B, T)]


def test_the_served_walk_through_comes_with_the_layers(server, tiny_model, tokenizer):
    body = {"prompt": PROMPT, "include_layers": True}
    data = httpx.post(f"{server.http_url}/v1/next-token", json=body, timeout=30).json()
    T = len(tokenizer.encode(PROMPT))
    want = expected(tiny_model.model.config, 1, T)
    drawn = {step["name"]: step["shape"] for step in data["walkthrough"]}
    assert {k: drawn[k] for k in want} == want
    assert {step["kind"] for step in data["walkthrough"]} == {"data", "weight"}
    plain = httpx.post(f"{server.http_url}/v1/next-token", json={"prompt": PROMPT}, timeout=30).json()
    assert plain["walkthrough"] == []  # only with the layers


def test_a_batched_request_shows_its_batch_dimension(server, tiny_model, tokenizer):
    prompts = [PROMPT, "Hello"]
    with Client(server.grpc_target) as client:
        results = client.next_token_batch(prompts, include_layers=True)
    T = max(len(tokenizer.encode(p)) for p in prompts)  # padded to the longest
    for result in results:
        drawn = {step.name: step.shape for step in result.walkthrough}
        assert drawn["Q per head"] == [2, tiny_model.model.config.n_head, T, tiny_model.model.config.d_head]
        assert drawn["token ids"] == [2, T] and drawn["logits"] == [2, tiny_model.model.config.vocab_size]
