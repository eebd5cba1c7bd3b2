"""What the layer-trace tests share: the prompt, the span names of random:tiny's layers, and the
check of one exported layer trace against the reference."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from .reference import assert_layer_matches, reference_layers

PROMPT = [464, 3139, 286, 4881, 318]  # "The capital of France is"


LAYER_SPANS = {"embed", "block 0", "block 1", "ln_f+unembed"}  # random:tiny has 2 blocks


def by_name(spans) -> dict:
    named = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def assert_layer_trace(spans, request_name: str, caller_span_id: str, model, prompt, batch_size: int, padded: int):
    named = by_name(spans)
    (request,) = named[request_name]
    (queue,) = named["queue"]
    (batch,) = named["batch"]
    (forward,) = named["forward"]
    assert request.kind == SpanKind.SERVER.value + 1  # OTLP enum: SPAN_KIND_SERVER = 2
    assert request.parent_span_id == caller_span_id
    assert request.attributes["gen_ai.request.model"] == "random:tiny"
    assert request.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert request.resource["service.name"] == "gpt2serve-under-test"
    assert request.resource["deployment.environment"] == "test"
    assert queue.parent_span_id == request.span_id and batch.parent_span_id == request.span_id
    assert (request.trace_id, request.span_id) in batch.links
    assert batch.attributes["gpt2serve.batch.size"] == batch_size
    assert forward.parent_span_id == batch.span_id
    for name in LAYER_SPANS:
        (span,) = named[name]
        assert span.parent_span_id == forward.span_id, name
        assert forward.start_ns <= span.start_ns <= span.end_ns <= forward.end_ns, name
    assert request.start_ns <= queue.start_ns <= queue.end_ns <= batch.start_ns + 1_000_000
    assert batch.end_ns <= request.end_ns

    cfg = model.config
    want = reference_layers(model, prompt)
    for index in range(cfg.n_layer):
        attrs = named[f"block {index}"][0].attributes
        assert len(attrs) < 64
        assert attrs["gpt2.layer.index"] == index
        assert attrs["gpt2.shape.hidden"] == [batch_size, padded, cfg.d_model]
        assert attrs["gpt2.shape.qkv"] == [batch_size, cfg.n_head, padded, cfg.d_head]
        assert attrs["gpt2.shape.attn_scores"] == [batch_size, cfg.n_head, padded, padded]
        assert attrs["gpt2.shape.mlp_hidden"] == [batch_size, padded, cfg.d_mlp]
        assert attrs["gpt2.request.shape.hidden"] == [len(prompt), cfg.d_model]
        assert attrs["gpt2.request.shape.attn_scores"] == [cfg.n_head, len(prompt), len(prompt)]
        got = {key.removeprefix("gpt2.head."): value for key, value in attrs.items() if key.startswith("gpt2.head.")}
        got["residual_norm"] = attrs["gpt2.residual_norm"]
        got["logit_lens_ids"] = attrs["gpt2.logit_lens.token_id"]
        got["logit_lens_probs"] = attrs["gpt2.logit_lens.prob"]
        assert_layer_matches(got, want[index])
        assert len(attrs["gpt2.head.top_token"]) == cfg.n_head
