"""Layer traces end to end: a real server exports over OTLP/gRPC to a receiver in this process.

The server samples nothing by ratio (--trace-sample-ratio 0), so every trace that arrives was
kept because it asked for its layers, or because its caller's context was sampled.
"""

from __future__ import annotations

import asyncio

import torch

import httpx
import pytest
from support.servers import launch_server
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id
from support.reference import assert_layer_matches, reference_layers
from support.tracing import LAYER_SPANS, PROMPT, assert_layer_trace, by_name

from gpt2serve_client import AsyncClient, Client, RestClient

LONG = [(i * 7919) % 50000 for i in range(250)]


@pytest.fixture(scope="module")
def traced_server(tmp_path_factory, receiver):
    env = receiver.server_env()
    # The length-grouping cost is pinned: the test of six requests in one batch must not depend
    # on a cost measured at start-up on a busy machine (see test_serving's shared server).
    srv = launch_server(tmp_path_factory.mktemp("traced"), "--model", "random:tiny", "--trace-sample-ratio", "0",
                        "--max-batch-delay-ms", "100", "--fixed-cost-tokens", "4096", env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client_tracer():
    """The caller's own tracing (not exported): its context must reach the server."""
    return TracerProvider().get_tracer("test-caller")


def test_grpc_layer_trace_joins_the_callers_trace(traced_server, receiver, client_tracer, tiny_model):
    with client_tracer.start_as_current_span("caller") as caller, Client(traced_server.grpc_target) as client:
        result = client.next_token(PROMPT, top_k=3, trace_layers=True)
    caller_trace = format_trace_id(caller.get_span_context().trace_id)
    assert result.trace_id == caller_trace
    spans = receiver.wait_for(caller_trace, {"gpt2serve.v1.Gpt2Serve/NextToken", "queue", "batch", "forward"} | LAYER_SPANS)
    assert_layer_trace(spans, "gpt2serve.v1.Gpt2Serve/NextToken", format_span_id(caller.get_span_context().span_id),
                       tiny_model.model, PROMPT, batch_size=1, padded=len(PROMPT))
    (request,) = by_name(spans)["gpt2serve.v1.Gpt2Serve/NextToken"]
    assert request.attributes["gen_ai.request.top_k"] == 3
    assert request.attributes["gpt2serve.prefix_cache.hit_tokens"] == 0  # set by telemetry, whether or not a cache ran


def test_rest_layer_trace_joins_the_callers_trace(traced_server, receiver, client_tracer, tiny_model):
    with client_tracer.start_as_current_span("caller") as caller, RestClient(traced_server.http_url) as client:
        result = client.next_token(PROMPT, trace_layers=True, include_layers=True)
    caller_trace = format_trace_id(caller.get_span_context().trace_id)
    assert result.trace_id == caller_trace
    spans = receiver.wait_for(caller_trace, {"POST /v1/next-token", "queue", "batch", "forward"} | LAYER_SPANS)
    assert_layer_trace(spans, "POST /v1/next-token", format_span_id(caller.get_span_context().span_id),
                       tiny_model.model, PROMPT, batch_size=1, padded=len(PROMPT))
    # include_layers returns the same numbers the spans carry.
    block = by_name(spans)["block 1"][0].attributes
    assert [h.entropy for h in result.layers[1].heads] == pytest.approx(block["gpt2.head.entropy"], abs=1e-6)


def test_traced_request_in_a_batch_with_untraced_ones_of_other_lengths(traced_server, receiver, tiny_model):
    """Two layer-traced requests share a batch with untraced ones: each trace holds its own layers,
    equal to the prompt computed alone (the 3-token one padded to 5); the untraced ones are
    not exported (ratio 0)."""
    others = [[40, 588], [1212, 318, 257, 1332], [50256], [11, 12, 13]]
    second = [8888, 7777, 6666]

    async def main():
        async with AsyncClient(traced_server.grpc_target) as client:
            async def round_of_six(traced: bool):
                calls = [client.next_token(p) for p in others]
                calls += [client.next_token(PROMPT, trace_layers=traced), client.next_token(second, trace_layers=traced)]
                return await asyncio.gather(*calls)

            # Occupy the model (~0.2 s) so the six queue up and leave the queue together.
            busy = asyncio.create_task(client.next_token_batch([LONG] * 64, top_k=1, timeout=60))
            await asyncio.sleep(0.05)
            six = await round_of_six(True)
            assert (await busy)[0].batch_size == 64
            return six

    *untraced, first_result, second_result = asyncio.run(main())
    assert [r.batch_size for r in (*untraced, first_result, second_result)] == [6] * 6, "not one batch"
    assert all(r.trace_id == "" for r in untraced)
    named_first = by_name(receiver.wait_for(first_result.trace_id, LAYER_SPANS))
    named_second = by_name(receiver.wait_for(second_result.trace_id, LAYER_SPANS))
    # One shared batch span (in the first traced request's trace), linked to both requests.
    batch_spans = named_first.get("batch", []) + named_second.get("batch", [])
    assert len(batch_spans) == 1
    linked_traces = {trace_id for trace_id, _ in batch_spans[0].links}
    assert linked_traces == {first_result.trace_id, second_result.trace_id}
    for result, prompt, named in ((first_result, PROMPT, named_first), (second_result, second, named_second)):
        for index in range(tiny_model.model.config.n_layer):
            attrs = named[f"block {index}"][0].attributes
            batch_rows, padded = attrs["gpt2.shape.hidden"][:2]
            assert [batch_rows, padded] == [6, len(PROMPT)]  # the 3-token prompt is padded to 5
            assert attrs["gpt2.request.shape.hidden"][0] == len(prompt)
            got = {k.removeprefix("gpt2.head."): v for k, v in attrs.items() if k.startswith("gpt2.head.")}
            want = reference_layers(tiny_model.model, prompt)[index]
            want.pop("residual_norm", None)
            want.pop("logit_lens_ids", None)
            want.pop("logit_lens_probs", None)
            assert_layer_matches(got, want)


def test_unsampled_requests_are_not_exported_and_return_no_trace_id(traced_server, receiver):
    with Client(traced_server.grpc_target) as client:
        plain = client.next_token([1, 2, 3, 4, 5, 6, 7])
        marker = client.next_token(PROMPT, trace_layers=True)
    assert plain.trace_id == "" and plain.layers == []
    receiver.wait_for(marker.trace_id, LAYER_SPANS)  # exported after the plain request ended
    prompt_tokens = {s.attributes.get("gen_ai.usage.input_tokens") for s in receiver.spans
                     if s.kind == SpanKind.SERVER.value + 1}
    assert 7 not in prompt_tokens, "the unsampled 7-token request was exported"


def test_include_layers_without_tracing(traced_server):
    with Client(traced_server.grpc_target) as client:
        result = client.next_token(PROMPT, include_layers=True)
    assert result.trace_id == ""  # ratio 0 and no trace_layers: nothing exported
    assert [layer.index for layer in result.layers] == [0, 1]
    assert result.layers[-1].logit_lens[0].token_id == result.token_id


def test_layer_reports_over_rest_equal_grpc(traced_server):
    with Client(traced_server.grpc_target) as grpc_client:
        via_grpc = grpc_client.next_token(PROMPT, include_layers=True).layers
    body = {"prompt_token_ids": PROMPT, "include_layers": True}
    via_rest = httpx.post(f"{traced_server.http_url}/v1/next-token", json=body).json()["layers"]
    assert len(via_rest) == len(via_grpc)
    for rest_layer, grpc_layer in zip(via_rest, via_grpc):
        assert rest_layer["hidden_shape"] == grpc_layer.hidden_shape
        assert [h["top_token"] for h in rest_layer["heads"]] == [h.top_token for h in grpc_layer.heads]
        assert [h["entropy"] for h in rest_layer["heads"]] == pytest.approx([h.entropy for h in grpc_layer.heads],
                                                                            abs=1e-5)


def test_no_trace_id_when_the_server_exports_nothing(server, client_tracer):
    """The session server has no OTLP endpoint: even a sampled caller gets no trace id back,
    since no span of this request will exist anywhere; include_layers still works."""
    with client_tracer.start_as_current_span("caller"), Client(server.grpc_target) as client:
        result = client.next_token(PROMPT, trace_layers=True, include_layers=True)
    assert result.trace_id == ""
    assert len(result.layers) == 2


def test_generate_trace_has_its_steps_and_the_prompts_layers(traced_server, receiver, client_tracer, tiny_model):
    """A traced generation: its request span, the prompt's forward layer by layer, then one span
    per engine step (a prefill and the decodes), each a child of the request (it ran alone)."""
    with client_tracer.start_as_current_span("caller") as caller, Client(traced_server.grpc_target) as client:
        result = client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, trace_layers=True)
    trace_id = format_trace_id(caller.get_span_context().trace_id)
    assert result.trace_id == trace_id
    name = "gpt2serve.v1.Gpt2Serve/Generate"
    spans = receiver.wait_for(trace_id, {name, "batch", "forward", "prefill", "decode"} | LAYER_SPANS)
    named = by_name(spans)
    (request,) = named[name]
    assert request.parent_span_id == format_span_id(caller.get_span_context().span_id)
    assert request.attributes["gen_ai.usage.output_tokens"] == 6
    assert request.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert list(request.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert request.attributes["gen_ai.request.max_tokens"] == 6
    (prefill,) = named["prefill"]
    decodes = named["decode"]
    assert len(decodes) == 5  # the first token came with the prefill
    for step in [prefill, *decodes]:
        assert step.parent_span_id == request.span_id
        assert request.start_ns <= step.start_ns <= step.end_ns <= request.end_ns
    assert prefill.attributes["gpt2serve.step.tokens_in"] == len(PROMPT)
    assert all(prefill.end_ns <= d.start_ns for d in decodes)
    for layer in LAYER_SPANS:
        assert named[layer][0].start_ns <= prefill.start_ns  # the prompt's layers, before generating


def test_a_generations_controls_and_structured_output_are_on_its_span(traced_server, receiver, client_tracer):
    with client_tracer.start_as_current_span("caller") as caller, Client(traced_server.grpc_target) as client:
        client.generate(PROMPT, max_tokens=8, temperature=0.5, presence_penalty=0.5, repetition_penalty=1.2,
                        logit_bias={11: 1.0, 13: -1.0}, min_p=0.05, regex="[0-9]{3}")
    trace_id = format_trace_id(caller.get_span_context().trace_id)
    name = "gpt2serve.v1.Gpt2Serve/Generate"
    (request,) = by_name(receiver.wait_for(trace_id, {name}))[name]
    attributes = request.attributes
    assert attributes["gen_ai.request.presence_penalty"] == 0.5 and "gen_ai.request.frequency_penalty" not in attributes
    assert attributes["gpt2serve.request.repetition_penalty"] == pytest.approx(1.2)
    assert attributes["gpt2serve.request.logit_bias_tokens"] == 2
    assert attributes["gpt2serve.request.min_p"] == pytest.approx(0.05)
    assert attributes["gpt2serve.structured_output.kind"] == "regex"
    assert attributes["gpt2serve.structured_output.field"] == "regex"
    assert "gpt2serve.structured_output.steps" in attributes


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_structured_outputs_span_sums_up_what_its_grammar_allowed(traced_server, receiver, client_tracer, tmp_path,
                                                                    workers):
    """The generation's own count at each step (the end of text's included), in summary; the
    traced steps, which rebuild each step apart, agree with it. With the engine in process, and
    behind IPC (the counts travel in its token messages)."""
    choices = ["yes please", "no thanks"]
    server = traced_server if workers == "1" else launch_server(
        tmp_path, "--model", "random:tiny", "--trace-sample-ratio", "0", "--workers", workers,
        env=receiver.server_env())
    try:
        with client_tracer.start_as_current_span("caller") as caller, Client(server.grpc_target) as client:
            result = client.generate(PROMPT, max_tokens=12, temperature=0.7, seed=4, choice=choices, trace_steps=True)
    finally:
        if server is not traced_server:
            server.stop()
    trace_id = format_trace_id(caller.get_span_context().trace_id)
    name = "gpt2serve.v1.Gpt2Serve/Generate"
    attributes = by_name(receiver.wait_for(trace_id, {name}))[name][0].attributes
    per_step = list(attributes["gpt2serve.structured_output.allowed_tokens.per_step"])
    assert result.finish_reason == "eos" and len(per_step) == len(result.tokens) + 1 == len(result.steps) + 1
    assert per_step[:-1] == [step.allowed_tokens for step in result.steps]
    assert per_step[-1] == 1  # the whole choice is out: only the end of text
    assert attributes["gpt2serve.structured_output.steps"] == len(per_step)
    assert attributes["gpt2serve.structured_output.allowed_tokens.min"] == min(per_step) == 1
    assert attributes["gpt2serve.structured_output.allowed_tokens.max"] == max(per_step)
    assert attributes["gpt2serve.structured_output.allowed_tokens.median"] == sorted(per_step)[len(per_step) // 2]
    assert attributes["gpt2serve.structured_output.forced_steps"] == per_step.count(1)
    (first,) = by_name(receiver.wait_for(trace_id, {"generation step 0"}))["generation step 0"]
    assert first.attributes["gpt2serve.step.allowed_tokens"] == per_step[0]
    assert list(first.attributes["gpt2serve.step.controlled_top.token"]) == [t.token for t in result.steps[0].controlled_top]


def test_traced_steps_are_spans_of_the_generation(traced_server, receiver, client_tracer, tiny_model):
    """trace_steps in a traced request: a span per step, from the token before to its own, with
    what the step's trace says (its token, cache, lens, top tokens)."""
    with client_tracer.start_as_current_span("caller") as caller, Client(traced_server.grpc_target) as client:
        result = client.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True, trace_steps=True)
    trace_id = format_trace_id(caller.get_span_context().trace_id)
    name = "gpt2serve.v1.Gpt2Serve/Generate"
    step_names = {f"generation step {i}" for i in range(4)}
    named = by_name(receiver.wait_for(trace_id, {name} | step_names))
    (request,) = named[name]
    cfg = tiny_model.model.config
    previous_end = request.start_ns
    for i, step in enumerate(result.steps):
        (span,) = named[f"generation step {i}"]
        attrs = span.attributes
        assert span.parent_span_id == request.span_id
        assert previous_end <= span.start_ns <= span.end_ns  # one after the other
        previous_end = span.end_ns
        assert attrs["gpt2serve.step.kind"] == ("prefill" if i == 0 else "decode")
        assert attrs["gpt2serve.step.context_tokens"] == len(PROMPT) + i
        assert attrs["gpt2serve.step.token_id"] == result.tokens[i].token_id == step.token_id
        assert attrs["gpt2.shape.kv_cache_per_layer"] == [cfg.n_head, len(PROMPT) + i, cfg.d_head]
        assert attrs["gpt2serve.step.top.token"] == [t.token for t in step.top]
        assert attrs["gpt2.logit_lens.token"] == [t.token for t in step.logit_lens]
        assert len(attrs["gpt2.attention.focus_position"]) == cfg.n_layer


def test_a_scored_request_carries_a_summary_of_its_prompt_not_the_table(traced_server, receiver, tiny_model):
    from support.reference import reference_prompt_logprobs

    prompts = [PROMPT, LONG[:40]]
    with Client(traced_server.grpc_target) as client:
        results = client.next_token_batch(prompts, trace_layers=True, prompt_logprobs=2)
    spans = receiver.wait_for(results[0].trace_id, {"gpt2serve.v1.Gpt2Serve/NextTokenBatch"})
    (request,) = by_name(spans)["gpt2serve.v1.Gpt2Serve/NextTokenBatch"]
    attributes = request.attributes
    for i, prompt in enumerate(prompts):
        ref = reference_prompt_logprobs(tiny_model.model, prompt)[:-1]
        actual = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]  # (T-1,)
        assert attributes["gpt2serve.prompt_logprobs.mean"][i] == pytest.approx(actual.mean().item(), abs=1e-4)
        assert attributes["gpt2serve.prompt_logprobs.worst_position"][i] == int(actual.argmin()) + 1
        assert attributes["gpt2serve.prompt_logprobs.worst_logprob"][i] == pytest.approx(actual.min().item(), abs=1e-4)
    assert len(attributes) < 40  # a summary: no per-position attribute


def test_a_generation_hung_up_on_keeps_its_usage_so_far(traced_server, receiver, client_tracer):
    """Telemetry sets the usage at the span's end, however it ends: a stream the caller closed
    after two tokens says so, with no finish reason (it did not finish)."""
    async def two_tokens_then_close() -> None:
        async with AsyncClient(traced_server.grpc_target) as client:
            chunks = client.generate_stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True, trace_layers=True)
            got = 0
            async for chunk in chunks:
                got += chunk.token is not None
                if got == 2:
                    break
            await chunks.aclose()  # hangs up

    with client_tracer.start_as_current_span("caller") as caller:
        asyncio.run(two_tokens_then_close())
    trace_id = format_trace_id(caller.get_span_context().trace_id)
    (request,) = by_name(receiver.wait_for(trace_id, {"gpt2serve.v1.Gpt2Serve/Generate"}))["gpt2serve.v1.Gpt2Serve/Generate"]
    assert request.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert 2 <= request.attributes["gen_ai.usage.output_tokens"] < 200
    assert "gen_ai.response.finish_reasons" not in request.attributes
