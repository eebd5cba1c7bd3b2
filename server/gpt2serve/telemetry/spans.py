"""Spans for one request, built from what the scheduler and engine report.

    request (SERVER: gRPC method or HTTP route, GenAI attributes)
    ├── queue                         (this request waiting for a batch)
    └── batch                         (shared: one span per batch, linked to every sampled request in it)
        └── forward
            ├── embed
            ├── block 0 .. block N-1  (only for a request that asked for its layers)
            └── ln_f+unembed

    generate request (SERVER)
    ├── batch ... (the prompt's forward, layer by layer, when it asked for trace_layers)
    ├── prefill                       (shared: one span per step, a child of its first sampled
    └── decode, decode, ...            sequence's request, linked to the others)

The shared `batch` span has one parent: the first request in the batch that asked for its
layers (else the first sampled one). Another layer-traced request in the same batch gets its
own `forward` subtree under its own request span, linked to the batch, so every layer-traced
request finds its layers in its own trace. Spans are created after the fact with the engine's
timestamps, so the model loop itself holds no telemetry calls.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags, format_trace_id,
)

from gpt2serve_client.generation import GenerationStep
from gpt2serve_client.types import LayerReport

from ..protocol import GenerateRequest, PromptScores, TraceContext
from .logs import RequestLog, safe_field
from .metrics import Metrics
from .records import (BatchDone, FirstToken, ModelLoaded, PrefixCacheUse, RequestDone, RequestOptions, RequestRefused,
                      SchedulerStats, StepDone)
from .tracing import REQUEST_ID_HEADER, TRACE_LAYERS_ATTRIBUTE, trace_parent

# A caller's cancel this close to its deadline is the deadline: the server's copy of it starts
# when the request arrives, so the client's own expiry (and its cancel) can come a little earlier.
DEADLINE_SLACK_S = 0.05


def exported_trace_id(span: Span) -> str:
    """The span's hex trace id if it is recorded and sampled (so it will exist in a backend), else ""."""
    context = span.get_span_context()
    return format_trace_id(context.trace_id) if span.is_recording() and context.trace_flags.sampled else ""


def traceparent(span: Span) -> str:
    """The span as a W3C traceparent, what crosses to the engine side (protocol.TraceContext)."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


@functools.lru_cache(maxsize=4096)
def span_context(traceparent: str) -> SpanContext:
    """A traceparent back as the span context that engine-side spans hang from."""
    try:
        _, trace_id, span_id, flags = traceparent.split("-")
        return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    except ValueError:
        return SpanContext(0, 0, is_remote=True, trace_flags=TraceFlags(0))


def layer_attributes(report: LayerReport, row: int) -> dict:
    """About 25 plain attributes: the SDK keeps 128 a span and silently drops tensors."""
    heads = report.heads
    beside_base = {} if report.base_residual_shift is None else {  # compare_base: the adapter against the base
        "gpt2.adapter.residual_shift": report.base_residual_shift, "gpt2.adapter.attn_shift": report.base_attn_shift,
        "gpt2.adapter.mlp_shift": report.base_mlp_shift, "gpt2.base.logit_lens.token": [t.token for t in report.base_logit_lens]}
    return {
        "gpt2.layer.index": report.index,
        "gpt2.batch.row": row,
        "gpt2.shape.hidden": report.batch_hidden_shape,
        "gpt2.shape.qkv": report.batch_qkv_shape,
        "gpt2.shape.attn_scores": report.batch_attn_shape,
        "gpt2.shape.mlp_hidden": report.batch_mlp_shape,
        "gpt2.request.shape.hidden": report.hidden_shape,
        "gpt2.request.shape.qkv": report.qkv_shape,
        "gpt2.request.shape.attn_scores": report.attn_shape,
        "gpt2.request.shape.mlp_hidden": report.mlp_shape,
        "gpt2.head.entropy": [h.entropy for h in heads],
        "gpt2.head.max_weight": [h.max_weight for h in heads],
        "gpt2.head.top_position": [h.top_position for h in heads],
        "gpt2.head.top_token_id": [h.top_token_id for h in heads],
        "gpt2.head.top_token": [h.top_token for h in heads],
        "gpt2.head.first_token_weight": [h.first_token_weight for h in heads],
        "gpt2.head.previous_token_score": [h.previous_token_score for h in heads],
        "gpt2.residual_norm": report.residual_norm,
        "gpt2.attn_output_norm": report.attn_output_norm,
        "gpt2.mlp_output_norm": report.mlp_output_norm,
        "gpt2.logit_lens.token": [t.token for t in report.logit_lens],
        "gpt2.logit_lens.token_id": [t.token_id for t in report.logit_lens],
        "gpt2.logit_lens.prob": [t.prob for t in report.logit_lens],
        **beside_base,
    }


def step_attributes(step: GenerationStep) -> dict:
    """A traced generation step as plain attributes (top tokens, logit lens, where attention went)."""
    length, n_head = step.context_tokens, step.n_head
    focus = []  # per layer: the cache position the heads' mean attention weighs most
    for layer in range(step.n_layer):
        rows = [step.attention_row(layer, head) for head in range(n_head)]
        mean = [sum(column) / n_head for column in zip(*rows)]
        focus.append(max(range(length), key=mean.__getitem__))
    return {
        "gpt2serve.step.index": step.index, "gpt2serve.step.kind": "prefill" if step.index == 0 else "decode",
        "gpt2serve.step.position": step.position, "gpt2serve.step.context_tokens": length,
        "gpt2serve.step.token_id": step.token_id, "gpt2serve.step.token": step.token,
        "gpt2.shape.new_rows": step.new_row_shape, "gpt2.shape.kv_cache_per_layer": step.kv_cache_shape,
        "gpt2serve.step.top.token": [t.token for t in step.top],
        "gpt2serve.step.top.logprob": [t.logprob for t in step.top],
        "gpt2.logit_lens.token": [t.token for t in step.logit_lens],
        "gpt2.logit_lens.prob": [t.prob for t in step.logit_lens],
        "gpt2.attention.focus_position": focus,
        **({"gpt2serve.step.allowed_tokens": step.allowed_tokens,
            "gpt2serve.step.controlled_top.token": [t.token for t in step.controlled_top],
            "gpt2serve.step.controlled_top.logprob": [t.logprob for t in step.controlled_top]}
           if step.allowed_tokens else {}),
    }


def generation_attributes(generate: GenerateRequest, constraint: tuple[str, str, str] | None) -> dict:
    """A generation's settings on its request span: OpenTelemetry's GenAI names where they exist,
    gpt2serve's for the other controls (only those set), and a structured output's kind and the
    request field it came from (`constraint`: kind, spec, field)."""
    params = generate.params
    attributes = {"gen_ai.request.max_tokens": generate.max_tokens, "gen_ai.request.temperature": params.temperature,
                  "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k}
    if generate.seed is not None:
        attributes["gen_ai.request.seed"] = generate.seed
    for name, value, off in (("gen_ai.request.presence_penalty", params.presence_penalty, 0.0),
                             ("gen_ai.request.frequency_penalty", params.frequency_penalty, 0.0),
                             ("gpt2serve.request.repetition_penalty", params.repetition_penalty, 1.0),
                             ("gpt2serve.request.min_p", params.min_p, 0.0),
                             ("gpt2serve.request.min_tokens", params.min_tokens, 0),
                             ("gpt2serve.request.logit_bias_tokens", len(params.logit_bias), 0)):
        if value != off:
            attributes[name] = value
    if constraint is not None:
        kind, _, field = constraint
        attributes["gpt2serve.structured_output.kind"] = kind
        attributes["gpt2serve.structured_output.field"] = field
    return attributes


ALLOWED_STEPS_SHOWN = 128  # a structured output's first steps, each with its allowed count


def allowed_tokens_attributes(allowed: list[int]) -> dict:
    """A structured output's allowed-token counts, one per step, in summary: the least, median
    and most, the steps its grammar forced (one token allowed), and the first steps' counts."""
    ordered = sorted(allowed)
    return {
        "gpt2serve.structured_output.steps": len(allowed),
        "gpt2serve.structured_output.allowed_tokens.min": ordered[0],
        "gpt2serve.structured_output.allowed_tokens.median": ordered[len(ordered) // 2],
        "gpt2serve.structured_output.allowed_tokens.max": ordered[-1],
        "gpt2serve.structured_output.forced_steps": sum(n == 1 for n in allowed),
        "gpt2serve.structured_output.allowed_tokens.per_step": allowed[:ALLOWED_STEPS_SHOWN],
    }


class RequestTelemetry:
    """One request in flight: its server span, open until `finish`."""

    def __init__(self, telemetry: Telemetry, options: RequestOptions):
        self.telemetry, self.options = telemetry, options
        attributes = {**options.attributes, "gen_ai.operation.name": "text_completion",
                      "gen_ai.request.model": telemetry.model_name, TRACE_LAYERS_ATTRIBUTE: options.trace_layers}
        self.started = time.perf_counter()
        self._span = telemetry.tracer.start_span(options.span_name, context=trace_parent(options.trace_carrier),
                                                 kind=SpanKind.SERVER, attributes=attributes,
                                                 record_exception=False, set_status_on_exception=False)
        self.trace_id = exported_trace_id(self._span)  # the exemplar for the histograms
        self.finished = False
        self.adapter = ""  # the LoRA adapter the request named (adapter_chosen)
        telemetry.metrics.request_started()

    def finish(self, error: BaseException | None = None, *, prompt_tokens: int = 0, output_tokens: int = 0,
               queue_s: Sequence[float] = (), time_per_output_token_s: float | None = None,
               finish_reason: str | None = None) -> None:
        """End the span and count the request: OK, the error's status, or CANCELLED /
        DEADLINE_EXCEEDED for a caller that went away (anything not an Exception). The span's
        gen_ai.usage.* (tokens as far as the request got) and finish reason are set here."""
        if self.finished:
            return
        self.finished = True
        span, status = self._span, "OK"
        if isinstance(error, Exception):
            status = getattr(error, "code", "INTERNAL")
            span.set_attribute("error.type", status)
            if getattr(error, "http_status", 500) >= 500:  # A caller's mistake is not a server error.
                span.set_status(Status(StatusCode.ERROR, str(error)))
            with contextlib.suppress(AttributeError):
                error.counted = True  # the transports' error mappers count only what was not
        elif error is not None:
            deadline = self.options.deadline
            status = "DEADLINE_EXCEEDED" if deadline is not None and \
                time.monotonic() >= deadline - DEADLINE_SLACK_S else "CANCELLED"
        if span.is_recording() and (prompt_tokens or output_tokens):
            span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": output_tokens})
            if finish_reason is not None:
                span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        span.end()
        seconds = time.perf_counter() - self.started
        self.telemetry.metrics.request_done(RequestDone(
            self.options.api, self.options.method, status, seconds, self.trace_id,
            prompt_tokens, output_tokens, tuple(queue_s), time_per_output_token_s, self.adapter))
        request_log = self.telemetry.request_log
        if request_log is not None:
            options, carrier = self.options, self.options.trace_carrier
            reason, http = "", None
            if status != "OK":
                reason = getattr(error, "message", None) or str(error or status)
                known = getattr(error, "status", None)  # a ServeError's row of the status table
                if known is not None and options.api != "grpc":
                    http = known.openai_http if options.api == "openai" else known.http
            request_id = carrier.get(REQUEST_ID_HEADER) if carrier else None
            request_log.request(options.span_name, options.api, status, seconds, prompt_tokens, output_tokens,
                                request_id and safe_field(request_id, 128), self.trace_id, reason, http,
                                self.adapter and safe_field(self.adapter, 128))

    @property
    def traceparent(self) -> str:
        """This request's span as a W3C traceparent: what engine-side spans hang from."""
        return traceparent(self._span)

    # What the service tells of the request as it goes; the attributes are named here, and only here.

    def adapter_chosen(self, name: str | None) -> None:
        """The LoRA adapter the request runs under (None: the base): on its span, and counted by adapter."""
        if name:
            self.adapter = name
            self._span.set_attribute("gpt2serve.adapter", name)

    def next_token_settings(self, top_k: int) -> None:
        self._span.set_attribute("gen_ai.request.top_k", top_k)

    def generation_settings(self, generate: GenerateRequest, constraint: tuple[str, str, str] | None) -> None:
        if self._span.is_recording():  # most requests are not sampled: no attributes to build
            self._span.set_attributes(generation_attributes(generate, constraint))

    def prefix_cache_hit(self, tokens: int) -> None:
        """Prompt tokens the prefix cache held (all the call's prompts together)."""
        self._span.set_attribute("gpt2serve.prefix_cache.hit_tokens", tokens)

    def queued(self, start_ns: int, end_ns: int) -> None:
        """The `queue` span: the request's prompts waiting for their batch."""
        if self._span.is_recording():
            context = trace.set_span_in_context(self._span)
            self.telemetry.tracer.start_span("queue", context=context, start_time=start_ns).end(end_time=end_ns)

    def prompts_scored(self, scores: Sequence[PromptScores | None]) -> None:
        """A scored request's span carries a summary per prompt, not the table: the mean
        log-probability, and the least likely token's position (in the prompt) and log-probability."""
        scored = [s for s in scores if s is not None and len(s)]
        if scored and self._span.is_recording():
            worst = [min(range(len(s)), key=s.token_logprobs.__getitem__) for s in scored]
            self._span.set_attributes({
                "gpt2serve.prompt_logprobs.mean": [sum(s.token_logprobs) / len(s) for s in scored],
                "gpt2serve.prompt_logprobs.worst_position": [w + 1 for w in worst],
                "gpt2serve.prompt_logprobs.worst_logprob": [s.token_logprobs[w] for s, w in zip(scored, worst)]})

    def structured_output_steps(self, allowed: list[int]) -> None:
        """A structured output's allowed-token count at each step, in summary."""
        if allowed and self._span.is_recording():  # as generation_settings: nothing built for an unsampled span
            self._span.set_attributes(allowed_tokens_attributes(allowed))

    def __enter__(self) -> RequestTelemetry:
        return self

    def __exit__(self, _type, error: BaseException | None, _traceback) -> None:
        self.finish(error)  # no-op once finished: the body finishes it with its token counts

    def step_span(self, step: GenerationStep, start_ns: int, end_ns: int) -> None:
        """A traced generation step (trace_steps), from the previous token to this one. Steps are
        traced beside the generation, so the last may end after the request span did."""
        if self.trace_id:  # recorded and sampled (is_recording() turns false once the span ends)
            self.telemetry.tracer.start_span(
                f"generation step {step.index}", context=trace.set_span_in_context(self._span), start_time=start_ns,
                attributes=step_attributes(step)).end(end_time=end_ns)


class Telemetry:
    def __init__(self, model_name: str = "", vocab_size: int = 0, tracer: trace.Tracer | None = None,
                 metrics: Metrics | None = None):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tracer = tracer or trace.get_tracer("gpt2serve")
        self.metrics = metrics or Metrics()
        self.request_log: RequestLog | None = None  # set by a front end (--disable-log-requests: failures only)

    def start_request(self, options: RequestOptions) -> RequestTelemetry:
        """A request from start to answer: ended by its `finish`, or used as a context, where what
        is raised inside fails it (and still raises)."""
        return RequestTelemetry(self, options)

    def model_loaded(self, record: ModelLoaded, stats: Callable[[], SchedulerStats],
                     device_memory: Callable[[], float], compat: str | None = None) -> None:
        """In the process that owns the model: span attributes name it, metrics export it."""
        self.model_name, self.vocab_size = record.model, record.vocab_size
        self.metrics.model_loaded(record, stats, device_memory, compat)

    def request_refused(self, record: RequestRefused) -> None:
        self.metrics.request_refused(record)
        if self.request_log is not None:
            self.request_log.request(safe_field(record.route) or record.method, record.api, record.code, 0.0, 0, 0,
                                     None, "", record.message or record.code, record.http_status)

    def first_token(self, record: FirstToken) -> None:
        self.metrics.first_token(record)

    def connection_refused(self, api: str) -> None:
        """A connection closed at once, past a front end's connection limit."""
        self.metrics.connections_refused.labels(api=api).inc()

    def connection_evicted(self, api: str) -> None:
        """A connection closed to make room for a new one (transport.http_connections)."""
        self.metrics.connections_evicted.labels(api=api).inc()

    def record_batch(self, record: BatchDone) -> None:
        """Called once per batch with each row's trace (row order)."""
        traces = record.traces
        self.metrics.batch(len(traces), record.forward_s)
        if record.prefix_cache is not None:
            self.metrics.prefix_cache(record.prefix_cache)
        sampled = [(row, t) for row, t in enumerate(traces) if t is not None and t.sampled]
        if not sampled:
            return
        owner_row, owner = next(((row, t) for row, t in sampled if t.layer_spans), sampled[0])
        batch = self.tracer.start_span(
            "batch", context=_context_of(owner), start_time=record.started_ns,
            links=[Link(span_context(t.traceparent)) for _, t in sampled],
            attributes={"gpt2serve.batch.size": len(traces), "gpt2serve.batch.padded_length": record.padded_len,
                        "gpt2serve.batch.sampled_requests": len(sampled),
                        **_prefix_attributes(record.prefix_cache)},
        )
        batch_link = Link(batch.get_span_context())
        self._forward(trace.set_span_in_context(batch), record, owner_row if owner.layer_spans else None, ())
        for row, t in sampled:
            if t.layer_spans and row != owner_row:
                self._forward(_context_of(t), record, row, (batch_link,))
        batch.end(end_time=record.ended_ns)

    def record_step(self, record: StepDone) -> None:
        """One span per generation step (prefill or decode) with a sampled sequence in it: a
        child of the first such sequence's request span, linked to the others'."""
        self.metrics.step(record.kind, record.rows, record.tokens_in, record.forward_s)
        if record.prefix_cache is not None:
            self.metrics.prefix_cache(record.prefix_cache)
        sampled = [t for t in record.traces if t is not None and t.sampled]
        if not sampled:
            return
        self.tracer.start_span(
            record.kind, context=_context_of(sampled[0]), start_time=record.started_ns,
            links=[Link(span_context(t.traceparent)) for t in sampled[1:]],
            attributes={"gpt2serve.step.sequences": record.rows, "gpt2serve.step.tokens_in": record.tokens_in,
                        "gpt2serve.step.sampled_requests": len(sampled), "gpt2serve.forward.ms": record.forward_s * 1000,
                        **_prefix_attributes(record.prefix_cache)},
        ).end(end_time=record.ended_ns)

    def _forward(self, context: Context, output: BatchDone, row: int | None, links: Sequence[Link]) -> None:
        forward = self.tracer.start_span("forward", context=context, start_time=output.started_ns, links=links,
                                         attributes={"gpt2serve.forward.ms": output.forward_s * 1000})
        timeline, reports = output.timeline, output.layers.get(row) if row is not None else None
        if timeline is not None and reports:
            inside = trace.set_span_in_context(forward)
            batch_size, padded = len(output.traces), output.padded_len
            d_model = reports[0].batch_hidden_shape[-1]
            self._child("embed", inside, timeline.embed, {
                "gpt2.shape.input_ids": [batch_size, padded], "gpt2.shape.hidden": [batch_size, padded, d_model]})
            for (start, end), report in zip(timeline.blocks, reports):
                self._child(f"block {report.index}", inside, (start, end), layer_attributes(report, row))
            self._child("ln_f+unembed", inside, timeline.unembed, {
                "gpt2.shape.hidden_last": [batch_size, d_model], "gpt2.shape.logits": [batch_size, self.vocab_size]})
        forward.end(end_time=output.ended_ns)

    def _child(self, name: str, context: Context, times: tuple[int, int], attributes: dict) -> None:
        self.tracer.start_span(name, context=context, start_time=times[0], attributes=attributes).end(end_time=times[1])


def _prefix_attributes(use: PrefixCacheUse | None) -> dict[str, int]:
    if use is None:
        return {}
    return {"gpt2serve.prefix_cache.queried_tokens": use.queried_tokens, "gpt2serve.prefix_cache.hit_tokens": use.hit_tokens}


def _context_of(t: TraceContext) -> Context:
    return trace.set_span_in_context(NonRecordingSpan(span_context(t.traceparent)))
