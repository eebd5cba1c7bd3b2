"""Every message between the front end (transports, service) and the engine side (scheduling,
model), and the one codec that puts them on the IPC wire.

    front end                                        engine side
    service ── EngineClient ──────────────────────── scheduling.Batcher / ContinuousBatcher
               ├ ipc.inproc_client (--workers 1: plain calls, no encoding)
               └ ipc.zmq_client ── encode/decode ── ipc:// ── ipc.engine_server (--workers N)

What crosses is plain data: token ids, numbers, layer reports, errors as (code, message) and the
W3C `traceparent` of the request span as a string. No torch and no OpenTelemetry SDK here, so a
front-end process never imports the model's libraries (tests/test_workers.py checks it).

A generation is a stream of TokenEvents; the last one carries its finish_reason. An error ends
it instead (`TokenSink.fail`). A caller that leaves cancels it through the handle `generate`
returned, which frees its KV-cache slot at the next step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import msgpack

from gpt2serve_client.types import LayerReport, ModelInfo, ShapeStep

# Engine-side messages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenScore:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TraceContext:
    """What telemetry needs of a request on the engine side: its span (W3C traceparent,
    "00-<32 hex trace id>-<16 hex span id>-<flags>") and what it asked to see."""

    traceparent: str = ""
    sampled: bool = False  # the request span is recorded and will be exported
    layers_wanted: bool = False  # compute per-layer reports (include_layers, or exported layer spans)
    layer_spans: bool = False  # export per-layer spans
    layers_in_response: bool = False  # the answer waits for the reports (include_layers)
    attention_maps: bool = False  # the reports carry full attention maps and the all-position lens
    # With attention_maps: only each map's last query row, and no all-position lens (a traced
    # generation step: the new row over the cache; service.step_trace).
    last_row_maps: bool = False


@dataclass(frozen=True)
class NextTokenRequest:
    prompts: list[list[int]]  # token ids; answered together or refused together
    top_k: int
    trace: TraceContext | None = None


@dataclass(frozen=True)
class NextTokenOutput:
    """One prompt's answer."""

    top: list[TokenScore]  # most likely first
    queue_s: float
    forward_s: float
    batch_size: int
    enqueued_ns: int  # wall clock, for the queue span
    batch_started_ns: int
    layers: list[LayerReport] | None = None  # when its trace asked for them
    walkthrough: list[ShapeStep] | None = None  # with the layers: the forward's shapes


# Temperatures below this are greedy (as in vLLM): the distribution is one-hot in float32 anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    logprobs: int = 0  # top alternatives reported per token

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class GenerateRequest:
    """A generate call as the engine side sees it: token ids and numbers, no text."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None
    deadline: float | None = None  # time.monotonic() (CLOCK_MONOTONIC: every process's) for a cache slot
    trace: TraceContext | None = None


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top: list[TokenScore] = field(default_factory=list)  # the `logprobs` best alternatives


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token. `finish_reason` is set on the last: "length", or "eos" / "stop" when
    this token is the end-of-text / a stop token (then not part of the output)."""

    token: SampledToken
    finish_reason: str = ""
    queue_s: float = 0.0  # waiting for a cache slot (first event only)
    forward_s: float = 0.0  # the step's forward
    batch_size: int = 0  # sequences in that forward


class TokenSink(Protocol):
    """Where a generation's events go; called on the event loop, never blocking."""

    def put(self, event: TokenEvent) -> None: ...

    def fail(self, error: Exception) -> None: ...


class EngineClient(Protocol):
    """The engine as the service sees it, in this process or behind the IPC door."""

    max_batch_size: int

    async def next_token(self, request: NextTokenRequest) -> list[NextTokenOutput]: ...

    def generate(self, request: GenerateRequest, sink: TokenSink) -> Callable[[], None]:
        """Start a generation (refusals raise here); returns what cancels it."""
        ...


# The IPC envelope ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:  # front end -> engine, first: the engine watches this process (see ipc.engine_server)
    pid: int


@dataclass(frozen=True)
class EngineReady:  # engine -> front end, once its model is loaded and warm
    model_info: ModelInfo
    tokenizer_source: str
    max_batch_size: int


@dataclass(frozen=True)
class Submit:
    request_id: int
    request: NextTokenRequest


@dataclass(frozen=True)
class Generate:
    request_id: int
    request: GenerateRequest


@dataclass(frozen=True)
class Cancel:  # the caller left: the prompts leave the queue, or the generation its slot
    request_id: int


@dataclass(frozen=True)
class Result:
    request_id: int
    outputs: list[NextTokenOutput]


@dataclass(frozen=True)
class Step:
    request_id: int
    event: TokenEvent


@dataclass(frozen=True)
class Failed:
    request_id: int
    code: str  # gRPC status name (errors.error_from_code turns it back into an error)
    message: str


class BadFrame(ValueError):
    """A frame that is not a list of known messages; the receiver logs it and drops it."""


# The codec: each message is [tag, field, ...], a frame one msgpack list of messages ------------------

def _int(x: Any) -> int:
    if type(x) is not int:
        raise BadFrame(f"expected an integer, got {type(x).__name__}")
    return x


def _float(x: Any) -> float:
    if type(x) not in (float, int):
        raise BadFrame(f"expected a number, got {type(x).__name__}")
    return float(x)


def _str(x: Any) -> str:
    if type(x) is not str:
        raise BadFrame(f"expected a string, got {type(x).__name__}")
    return x


def _bool(x: Any) -> bool:
    if type(x) is not bool:
        raise BadFrame(f"expected a boolean, got {type(x).__name__}")
    return x


def _ids(x: Any) -> list[int]:
    if type(x) is not list or any(type(i) is not int for i in x):
        raise BadFrame("expected a list of integers")
    return x


def _optional(read: Callable[[Any], Any], x: Any) -> Any:
    return None if x is None else read(x)


def _fields(x: Any, n: int) -> list:
    if type(x) is not list or len(x) != n:
        raise BadFrame(f"expected {n} fields")
    return x


def _pack_scores(scores: list[TokenScore]) -> list:
    return [[s.token_id for s in scores], [s.logprob for s in scores]]


def _scores(x: Any) -> list[TokenScore]:
    ids, logprobs = _fields(x, 2)
    if len(_ids(ids)) != len(_fields(logprobs, len(ids))):
        raise BadFrame("scores: ids and logprobs differ in length")
    return [TokenScore(i, _float(v)) for i, v in zip(ids, logprobs)]


def _pack_trace(t: TraceContext | None) -> list | None:
    return None if t is None else [t.traceparent, t.sampled, t.layers_wanted, t.layer_spans, t.layers_in_response,
                                   t.attention_maps, t.last_row_maps]


def _trace(x: Any) -> TraceContext | None:
    if x is None:
        return None
    traceparent, *flags = _fields(x, 7)
    return TraceContext(_str(traceparent), *map(_bool, flags))


def _from_dicts(what: str, build: Callable[[], Any]) -> Any:
    """A part the client types build from dicts; whatever they trip on is a BadFrame."""
    try:
        return build()
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise BadFrame(f"{what}: {exc}") from None


def _layers(x: Any) -> list[LayerReport] | None:
    if x is None:
        return None
    return _from_dicts("layer reports", lambda: [LayerReport.from_dict(report) for report in x])


def _pack_output(o: NextTokenOutput) -> list:
    return [_pack_scores(o.top), o.queue_s, o.forward_s, o.batch_size, o.enqueued_ns, o.batch_started_ns,
            None if o.layers is None else [asdict(r) for r in o.layers],
            None if o.walkthrough is None else [asdict(s) for s in o.walkthrough]]


def _walkthrough(x: Any) -> list[ShapeStep] | None:
    if x is None:
        return None
    return _from_dicts("walk-through", lambda: [ShapeStep.from_dict(step) for step in x])


def _output(x: Any) -> NextTokenOutput:
    top, queue_s, forward_s, batch_size, enqueued_ns, started_ns, layers, walkthrough = _fields(x, 8)
    return NextTokenOutput(_scores(top), _float(queue_s), _float(forward_s), _int(batch_size), _int(enqueued_ns),
                           _int(started_ns), _layers(layers), _walkthrough(walkthrough))


def _pack_generate(r: GenerateRequest) -> list:
    p = r.params
    return [r.prompt, [p.temperature, p.top_k, p.top_p, p.logprobs], r.max_tokens, sorted(r.stop_token_ids),
            r.ignore_eos, r.seed, r.deadline, _pack_trace(r.trace)]


def _generate(x: Any) -> GenerateRequest:
    prompt, params, max_tokens, stop_ids, ignore_eos, seed, deadline, trace = _fields(x, 8)
    temperature, top_k, top_p, logprobs = _fields(params, 4)
    return GenerateRequest(_ids(prompt), SamplingParams(_float(temperature), _int(top_k), _float(top_p), _int(logprobs)),
                           _int(max_tokens), frozenset(_ids(stop_ids)), _bool(ignore_eos), _optional(_int, seed),
                           _optional(_float, deadline), _trace(trace))


def _pack_event(e: TokenEvent) -> list:
    t = e.token
    return [t.token_id, t.logprob, _pack_scores(t.top), e.finish_reason, e.queue_s, e.forward_s, e.batch_size]


def _event(x: Any) -> TokenEvent:
    token_id, logprob, top, finish, queue_s, forward_s, batch_size = _fields(x, 7)
    return TokenEvent(SampledToken(_int(token_id), _float(logprob), _scores(top)), _str(finish), _float(queue_s),
                      _float(forward_s), _int(batch_size))


def _model_info(x: Any) -> ModelInfo:
    return _from_dicts("model info", lambda: ModelInfo.from_dict(x))


def _list(x: Any) -> list:
    if type(x) is not list:
        raise BadFrame("expected a list")
    return x


def _unpack_ready(f: list) -> EngineReady:
    info, source, max_batch_size = _fields(f, 3)
    return EngineReady(_model_info(info), _str(source), _int(max_batch_size))


def _unpack_submit(f: list) -> Submit:
    request_id, (prompts, top_k, trace) = _int(_fields(f, 2)[0]), _fields(f[1], 3)
    return Submit(request_id, NextTokenRequest([_ids(p) for p in _list(prompts)], _int(top_k), _trace(trace)))


def _unpack_result(f: list) -> Result:
    request_id, outputs = _fields(f, 2)
    return Result(_int(request_id), [_output(o) for o in _list(outputs)])


def _unpack_failed(f: list) -> Failed:
    request_id, code, message = _fields(f, 3)
    return Failed(_int(request_id), _str(code), _str(message))


# tag -> (message type, pack: message -> fields, unpack: fields -> message)
_WIRE: dict[int, tuple[type, Callable[[Any], list], Callable[[list], Any]]] = {
    0: (Hello, lambda m: [m.pid], lambda f: Hello(_int(_fields(f, 1)[0]))),
    1: (EngineReady, lambda m: [asdict(m.model_info), m.tokenizer_source, m.max_batch_size], _unpack_ready),
    2: (Submit, lambda m: [m.request_id, [m.request.prompts, m.request.top_k, _pack_trace(m.request.trace)]],
        _unpack_submit),
    3: (Generate, lambda m: [m.request_id, _pack_generate(m.request)],
        lambda f: Generate(_int(_fields(f, 2)[0]), _generate(f[1]))),
    4: (Cancel, lambda m: [m.request_id], lambda f: Cancel(_int(_fields(f, 1)[0]))),
    5: (Result, lambda m: [m.request_id, [_pack_output(o) for o in m.outputs]], _unpack_result),
    6: (Step, lambda m: [m.request_id, _pack_event(m.event)], lambda f: Step(_int(_fields(f, 2)[0]), _event(f[1]))),
    7: (Failed, lambda m: [m.request_id, m.code, m.message], _unpack_failed),
}
_TAGS = {cls: (tag, pack) for tag, (cls, pack, _) in _WIRE.items()}
MESSAGE_TYPES = tuple(cls for cls, _, _ in _WIRE.values())


def encode(messages: list) -> bytes:
    """One frame: the messages, in order."""
    frame = []
    for message in messages:
        tag, pack = _TAGS[type(message)]
        frame.append([tag, *pack(message)])
    return msgpack.packb(frame)


def decode(frame: bytes) -> list:
    """The messages of one frame; BadFrame if any part of it is not a known message."""
    try:
        items = msgpack.unpackb(frame)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise BadFrame(f"not msgpack: {exc}") from None
    if type(items) is not list:
        raise BadFrame("a frame is a list of messages")
    messages = []
    for item in items:
        if type(item) is not list or not item or type(item[0]) is not int or item[0] not in _WIRE:
            raise BadFrame(f"unknown message {str(item)[:40]}")
        messages.append(_WIRE[item[0]][2](item[1:]))
    return messages
