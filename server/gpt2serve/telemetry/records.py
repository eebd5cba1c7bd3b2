"""What telemetry is told: one small record per event, as vLLM's IterationStats are.

Everything above telemetry (transports, service, scheduling, engine, introspection) builds
these; telemetry imports none of those layers, so it sits beside all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gpt2serve_client.types import LayerReport

from ..protocol import TraceContext


@dataclass(slots=True)  # not frozen: made per request (see protocol.PER_REQUEST)
class RequestOptions:
    """How a request arrived and what it asked to see; transports fill this in, and the request
    span and metrics take it whole."""

    api: str = "internal"  # "grpc", "rest" or "openai": the metrics label
    method: str = "NextToken"  # "NextToken", "NextTokenBatch", "Generate", "Completions" or "ChatCompletions"
    span_name: str = "next_token"  # "gpt2serve.v1.Gpt2Serve/NextToken", "POST /v1/next-token"
    # The caller's trace context as it sent it (W3C traceparent, tracestate: the fields the
    # propagators read, from gRPC metadata or HTTP headers), read by telemetry at the span's start:
    # so no OpenTelemetry object rides a request, and engine-side modules need no OpenTelemetry.
    trace_carrier: Mapping[str, str] | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)  # rpc.* / http.* span attributes
    trace_layers: bool = False
    include_layers: bool = False
    attention_maps: bool = False  # full attention maps and all-position logit lens (implies include_layers)
    compare_base: bool = False  # under an adapter: the base's forward beside it (implies include_layers)
    trace_steps: bool = False  # generation: how each token was chosen (service.step_trace)
    deadline: float | None = None  # time.monotonic() by which the caller gives up (gRPC deadline)

    @property
    def layers_in_response(self) -> bool:
        return self.include_layers or self.attention_maps or self.compare_base


@dataclass(slots=True)  # not frozen: made per request (see protocol.PER_REQUEST)
class RequestDone:
    """A request the service answered, or failed (status: the gRPC status name)."""

    api: str
    method: str
    status: str
    duration_s: float
    trace_id: str = ""  # the exemplar, when the request was sampled
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue_s: tuple[float, ...] = ()  # next-token: each prompt's wait for its batch
    time_per_output_token_s: float | None = None  # generation, past its first token
    adapter: str = ""  # the LoRA adapter it named, "" for the base


@dataclass(frozen=True)
class RequestRefused:
    """A request refused before the service saw it (API key, size, a body that is not JSON)."""

    api: str
    method: str
    code: str
    message: str = ""  # why, for the log
    route: str = ""  # the RPC or path, for the log
    http_status: int | None = None  # the HTTP status sent (REST, OpenAI)


@dataclass(frozen=True)
class FirstToken:
    """A generation's first token reached its caller's stream."""

    api: str
    method: str
    seconds: float
    trace_id: str = ""


@dataclass(frozen=True)
class ModelLoaded:
    model: str
    dtype: str
    device: str
    weights: str
    vocab_size: int
    adapters: int = 0  # --max-loras, else the LoRA adapters served (vllm:lora_requests_info's max_lora); 0: none


@dataclass(frozen=True)
class SchedulerStats:
    """The schedulers' load, read at each scrape (or refresh): what routers and autoscalers read."""

    prompts_waiting: int = 0  # queued for a next-token batch
    prompts_running: int = 0  # in the forward under way
    generations_waiting: int = 0  # for a KV-cache slot
    generations_running: int = 0
    kv_cache_usage: float = 0.0  # share of the slots held
    running_adapters: tuple[str, ...] = ()  # LoRA adapters of the generations running, by name
    waiting_adapters: tuple[str, ...] = ()  # and of the requests waiting


@dataclass
class ForwardTimeline:
    """Wall-clock spans of a traced forward's stages, in time.time_ns() units."""

    embed: tuple[int, int]
    blocks: list[tuple[int, int]]
    unembed: tuple[int, int]


@dataclass(frozen=True)
class PrefixCacheUse:
    """A forward's prompt tokens looked up in the prefix cache, and those found there."""

    queried_tokens: int
    hit_tokens: int


@dataclass(frozen=True)
class BatchDone:
    """One next-token forward, with each row's trace in row order."""

    traces: list[TraceContext | None]
    padded_len: int
    forward_s: float
    started_ns: int
    ended_ns: int
    timeline: ForwardTimeline | None = None  # when a row was traced
    layers: dict[int, list[LayerReport]] = field(default_factory=dict)  # traced row -> a report per block
    prefix_cache: PrefixCacheUse | None = None  # when the prefix cache is on


@dataclass(frozen=True)
class StepDone:
    """One generation step (prefill or decode), with the traces of its sequences."""

    kind: str
    traces: list[TraceContext | None]
    rows: int
    tokens_in: int
    forward_s: float
    started_ns: int
    ended_ns: int
    prefix_cache: PrefixCacheUse | None = None  # prefill, when the prefix cache is on
