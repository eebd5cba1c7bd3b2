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

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, format_trace_id,
)

from gpt2serve_client.types import LayerReport

from ..engine.engine import BatchOutput
from ..engine.generation import StepOutput
from .metrics import Metrics
from .tracing import TRACE_LAYERS_ATTRIBUTE

# A caller's cancel this close to its deadline is the deadline: the server's copy of it starts
# when the request arrives, so the client's own expiry (and its cancel) can come a little earlier.
DEADLINE_SLACK_S = 0.05


@dataclass(frozen=True)
class RequestTrace:
    """What a queued prompt carries for telemetry (opaque to the scheduler)."""

    span_context: SpanContext
    sampled: bool  # the request span is recorded and will be exported
    layers_wanted: bool  # compute per-layer reports for it (include_layers or exported layer spans)
    layer_spans: bool  # export per-layer spans for it
    layers_in_response: bool = False  # its answer waits for the reports (include_layers)
    attention_maps: bool = False  # its reports carry full attention maps and the all-position lens


def exported_trace_id(span: Span) -> str:
    """The span's hex trace id if it is recorded and sampled (so it will exist in a backend), else ""."""
    context = span.get_span_context()
    return format_trace_id(context.trace_id) if span.is_recording() and context.trace_flags.sampled else ""


def layer_attributes(report: LayerReport, row: int) -> dict:
    """About 25 plain attributes: the SDK keeps 128 a span and silently drops tensors."""
    heads = report.heads
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
    }


class Telemetry:
    def __init__(self, model_name: str = "", vocab_size: int = 0, tracer: trace.Tracer | None = None,
                 metrics: Metrics | None = None):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tracer = tracer or trace.get_tracer("gpt2serve")
        self.metrics = metrics or Metrics()

    @contextmanager
    def request_span(self, name: str, parent: Context | None, attributes: Mapping, trace_layers: bool,
                     api: str = "internal", method: str = "", deadline: float | None = None) -> Iterator[Span]:
        """The server span of one request, and its request metrics; records errors raised inside."""
        attributes = {**attributes, "gen_ai.operation.name": "text_completion",
                      "gen_ai.request.model": self.model_name, TRACE_LAYERS_ATTRIBUTE: trace_layers}
        started, status, trace_id = time.perf_counter(), "OK", ""
        self.metrics.in_flight.inc()
        try:
            with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                                   attributes=attributes, record_exception=False,
                                                   set_status_on_exception=False) as span:
                trace_id = exported_trace_id(span)  # exemplar for the histograms
                try:
                    yield span
                except Exception as exc:
                    status = getattr(exc, "code", "INTERNAL")
                    span.set_attribute("error.type", status)
                    if getattr(exc, "http_status", 500) >= 500:  # A caller's mistake is not a server error.
                        span.set_status(Status(StatusCode.ERROR, str(exc)))
                    with contextlib.suppress(AttributeError):
                        exc.counted = True  # the transports' error mappers count only what was not
                    raise
                except BaseException:  # The caller went away (task cancelled) or its deadline passed.
                    status = "DEADLINE_EXCEEDED" if deadline is not None and \
                        time.monotonic() >= deadline - DEADLINE_SLACK_S else "CANCELLED"
                    raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.request_finished(api, method, status, time.perf_counter() - started, trace_id)

    def queue_span(self, request_span: Span, start_ns: int, end_ns: int) -> None:
        if request_span.is_recording():
            context = trace.set_span_in_context(request_span)
            self.tracer.start_span("queue", context=context, start_time=start_ns).end(end_time=end_ns)

    def record_batch(self, traces: Sequence[RequestTrace | None], output: BatchOutput, started_ns: int) -> None:
        """Called once per batch with each row's trace (row order)."""
        self.metrics.batch(len(traces), output.forward_s)
        sampled = [(row, t) for row, t in enumerate(traces) if t is not None and t.sampled]
        if not sampled:
            return
        owner_row, owner = next(((row, t) for row, t in sampled if t.layer_spans), sampled[0])
        batch = self.tracer.start_span(
            "batch", context=_context_of(owner.span_context), start_time=started_ns,
            links=[Link(t.span_context) for _, t in sampled],
            attributes={"gpt2serve.batch.size": len(traces), "gpt2serve.batch.padded_length": output.padded_len,
                        "gpt2serve.batch.sampled_requests": len(sampled)},
        )
        batch_link = Link(batch.get_span_context())
        self._forward(trace.set_span_in_context(batch), output, owner_row if owner.layer_spans else None, ())
        for row, t in sampled:
            if t.layer_spans and row != owner_row:
                self._forward(_context_of(t.span_context), output, row, (batch_link,))
        batch.end(end_time=output.ended_ns)

    def record_step(self, traces: Sequence[RequestTrace | None], output: StepOutput) -> None:
        """One span per generation step (prefill or decode) with a sampled sequence in it: a
        child of the first such sequence's request span, linked to the others'."""
        sampled = [t for t in traces if t is not None and t.sampled]
        if not sampled:
            return
        self.tracer.start_span(
            output.kind, context=_context_of(sampled[0].span_context), start_time=output.started_ns,
            links=[Link(t.span_context) for t in sampled[1:]],
            attributes={"gpt2serve.step.sequences": output.rows, "gpt2serve.step.tokens_in": output.tokens_in,
                        "gpt2serve.step.sampled_requests": len(sampled), "gpt2serve.forward.ms": output.forward_s * 1000},
        ).end(end_time=output.ended_ns)

    def _forward(self, context: Context, output: BatchOutput, row: int | None, links: Sequence[Link]) -> None:
        forward = self.tracer.start_span("forward", context=context, start_time=output.started_ns, links=links,
                                         attributes={"gpt2serve.forward.ms": output.forward_s * 1000})
        timeline, reports = output.timeline, output.layers.get(row) if row is not None else None
        if timeline is not None and reports:
            inside = trace.set_span_in_context(forward)
            batch_size, padded = len(output.top), output.padded_len
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


def _context_of(span_context: SpanContext) -> Context:
    return trace.set_span_in_context(NonRecordingSpan(span_context))
