"""Every message between the front end (transports, service) and the engine side (scheduling,
model); ipc.codec puts them on the IPC wire.

    front end                                        engine side
    service ── EngineClient ──────────────────────── scheduling.EngineCore
               ├ ipc.inproc_client (--workers 1: plain calls, no encoding)
               └ ipc.socket_client ── ipc.codec ── Unix socket ── ipc.engine_server (--workers N)

What crosses is plain data: token ids, numbers, layer reports, errors as (code, message) and the
W3C `traceparent` of the request span as a string. No torch and no OpenTelemetry SDK here, so a
front-end process never imports the model's libraries (tests/processes/test_workers.py checks it).

A generation is a stream of TokenEvents; the last one carries its finish_reason. An error ends
it instead (`TokenSink.fail`). A caller that leaves cancels it through the handle `generate`
returned, which frees its KV-cache slot at the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol


from gpt2serve_client.types import LayerReport, ModelInfo, ShapeStep

from .top_tokens import TokenScore, TopRow, TopScores, TopTable, cut_rows, read_rows  # noqa: F401 (the messages' parts)

# Engine-side messages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptScores:
    """A scored prompt's positions 1..L-1, column by column (cheap to build, send and slice):
    entry j is about prompt token j + 1 given tokens 0..j. Token 0 has no log-probability."""

    token_logprobs: list[float]
    ranks: list[int]  # 1 + the tokens strictly more likely than the actual one
    top_ids: list[list[int]]  # k per position, most likely first (k may be 0)
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.token_logprobs)


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class TraceContext:
    """What telemetry needs of a request on the engine side: its span (W3C traceparent,
    "00-<32 hex trace id>-<16 hex span id>-<flags>") and what it asked to see."""

    traceparent: str = ""
    sampled: bool = False  # the request span is recorded and will be exported
    layers_wanted: bool = False  # compute per-layer reports (include_layers, or exported layer spans)
    layer_spans: bool = False  # export per-layer spans
    layers_in_response: bool = False  # the answer waits for the reports (include_layers)
    attention_maps: bool = False  # the reports carry full attention maps and the all-position lens
    last_row_maps: bool = False  # with attention_maps: each map's last query row alone (service.step_trace)
    compare_base: bool = False  # under an adapter: the base model's forward beside it (engine.engine._traced)


# PER_REQUEST: the types made per request (requests, answers, IPC messages) are slotted dataclasses,
# not frozen ones, though none is changed once made: a frozen one of 10 fields costs 1.8 µs to make
# (object.__setattr__ a field), a slotted one 0.23, and the engine makes several a request.
@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class NextTokenRequest:
    prompts: list[list[int]]  # token ids; answered together or refused together
    top_k: int
    trace: TraceContext | None = None
    prompt_logprobs: int | None = None  # score every prompt position too, with this many alternatives
    controls: StepControls | None = None  # a traced generation step's: its top tokens after them too
    adapter: str | None = None  # a LoRA adapter's name (--lora-modules); None: the base model


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class StepControls:
    """A traced generation step's controls (service.step_trace): its sampling settings and where its
    output starts, so the forward also shows its top tokens after them (logits_controls.controlled_view)."""

    params: SamplingParams
    prompt_length: int


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class NextTokenOutput:
    """One prompt's answer."""

    top: Sequence[TokenScore]  # most likely first (TopScores from the engine)
    queue_s: float
    forward_s: float
    batch_size: int
    enqueued_ns: int  # wall clock, for the queue span
    batch_started_ns: int
    layers: list[LayerReport] | None = None  # when its trace asked for them
    walkthrough: list[ShapeStep] | None = None  # with the layers: the forward's shapes
    prompt_logprobs: PromptScores | None = None  # when the request asked for them
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    # With the request's `controls`: the top tokens after them (temperature 1), and how many
    # tokens they left possible (the vocabulary when nothing masks).
    controlled_top: Sequence[TokenScore] | None = None
    allowed_tokens: int = 0
    base_top: Sequence[TokenScore] | None = None  # with compare_base: the base model's top tokens

    @property
    def plain(self) -> bool:
        """Only its top tokens, timings and cached count: what Answers and a Result's columns carry."""
        return (self.layers is None and self.walkthrough is None and self.prompt_logprobs is None
                and self.controlled_top is None and not self.allowed_tokens and self.base_top is None)


# Temperatures below this are greedy (as in vLLM): the distribution is one-hot in float32 anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    logprobs: int = 0  # top alternatives reported per token
    # The controls on a row's logits (engine.logits_controls has their formulas and order).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_p: float = 0.0
    min_tokens: int = 0
    banned_early: tuple[int, ...] = ()  # the tokens min_tokens holds back: end-of-text, stop tokens
    grammar: str = ""  # structured output: an llguidance grammar (engine.constraints); "" none

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def controlled(self) -> bool:
        """Any control on the row's logits before sampling (engine.logits_controls)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens > 0 or self.grammar)


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
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
    prompt_logprobs: int | None = None  # score the prompt in its prefill, with this many alternatives
    adapter: str | None = None  # a LoRA adapter's name (--lora-modules); None: the base model


_NO_ALTERNATIVES: list = []  # shared, never changed: a token's `top` when none were asked for


class SampledToken(NamedTuple):
    """A tuple, like TokenScore: one is made per generated token (a frozen dataclass cost twice
    as much)."""

    token_id: int
    logprob: float
    top: list[TokenScore] = _NO_ALTERNATIVES  # the `logprobs` best alternatives
    allowed: int = 0  # under a grammar: how many tokens it allowed at this step; 0 without one


class TokenEvent(NamedTuple):
    """One sampled token. `finish_reason` is set on the last: "length", or "eos" / "stop" when
    this token is the end-of-text / a stop token (then not part of the output). A tuple: one is
    made per token in every front end (a frozen dataclass cost 0.85 us, this 0.3)."""

    token: SampledToken
    finish_reason: str = ""
    queue_s: float = 0.0  # waiting for a cache slot (first event only)
    forward_s: float = 0.0  # the step's forward
    batch_size: int = 0  # sequences in that forward
    prompt_logprobs: PromptScores | None = None  # first event only, when the request asked for them
    cached_tokens: int = 0  # first event only: prompt tokens read from the prefix cache


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

    async def update_adapter(self, name: str, path: str | None) -> list[str]:
        """Load the LoRA adapter at `path` as `name`, or unload `name` (path None); the adapters
        served after it."""
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
class AdapterUpdate:  # front end -> engine: load the LoRA adapter at `path` as `name`, or unload it (path "")
    request_id: int
    name: str
    path: str


@dataclass(frozen=True)
class Adapters:  # engine -> front ends: the LoRA adapters served now, after AdapterUpdate `request_id`
    request_id: int  # -1: another front end's update
    names: list[str]


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Submit:
    request_id: int
    request: NextTokenRequest


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Generate:
    request_id: int
    request: GenerateRequest


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Cancel:  # the caller left: the prompts leave the queue, or the generation its slot
    request_id: int


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Result:
    request_id: int
    outputs: list[NextTokenOutput]


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Step:
    request_id: int
    event: TokenEvent


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Tokens:
    """Generated tokens in columns, one message for all of a front end's generations that took a
    token in the same step (a decode step of 256 sequences is one message, not 256). Only plain
    tokens travel so: a first token (its queue time, prompt scores, cached count) is a Step."""

    request_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reasons: list[str]
    tops: list[list[TokenScore]]  # each token's alternatives; [] for all when none were asked for
    forward_s: float  # the step's, shared by every token here
    batch_size: int
    allowed: list[int]  # each token's SampledToken.allowed; [] for all when no grammar ran

    def events(self):
        """(request id, its TokenEvent) for each token, in order."""
        allowed = self.allowed or [0] * len(self.request_ids)
        for request_id, token_id, logprob, finish, top, n in zip(self.request_ids, self.token_ids, self.logprobs,
                                                                 self.finish_reasons, self.tops, allowed):
            yield request_id, TokenEvent(SampledToken(token_id, logprob, top, n), finish, 0.0, self.forward_s,
                                         self.batch_size)


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Failed:
    request_id: int
    code: str  # gRPC status name (errors.error_from_code turns it back into an error)
    message: str


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Prompts:
    """Plain next-token requests in columns, one message for all a front end sends in one loop
    tick (256 unary calls are one message, not 256 Submits). Plain: one prompt, and nothing the
    engine keeps for it (no sampled trace, layers, prompt scores, controls or adapter); others are Submits."""

    request_ids: list[int]
    prompts: list[list[int]]
    top_ks: list[int]

    @staticmethod
    def plain(request: NextTokenRequest) -> bool:
        trace = request.trace
        return (len(request.prompts) == 1 and request.prompt_logprobs is None and request.controls is None
                and request.adapter is None and (trace is None or not (trace.sampled or trace.layers_wanted)))


@dataclass(slots=True)  # not frozen: made per request (see PER_REQUEST)
class Answers:
    """Plain one-prompt answers of one batch in columns, one message per front end (a batch of
    256 unary calls is one message, not 256 Results), as generated tokens travel (`Tokens`).
    Plain: the answer has only its top tokens and timings; the others go as Results. With `table`
    (engine side), `tops` holds rows of it, sent as their bytes; decoded, `tops` holds TopScores."""

    request_ids: list[int]
    tops: list[Sequence[TokenScore]] | list[int]
    queue_s: list[float]
    enqueued_ns: list[int]
    cached_tokens: list[int]  # [] for all when none came from the prefix cache
    forward_s: float  # the batch's, shared by every answer here
    batch_size: int
    batch_started_ns: int
    table: TopTable | None = None

    def extend(self, request_ids: list[int], tops: list[Sequence[TokenScore]] | list[int], queue_s: list[float],
               enqueued_ns: list[int], cached_tokens: list[int]) -> None:
        """More answers of the batch, a column of each (`tops`: rows of `table`, if set)."""
        self.request_ids += request_ids
        self.tops += tops
        self.queue_s += queue_s
        self.enqueued_ns += enqueued_ns
        self.cached_tokens += cached_tokens

    def outputs(self):
        """(request id, its [NextTokenOutput]) for each answer, in order."""
        cached = self.cached_tokens or [0] * len(self.request_ids)
        forward_s, batch_size, started_ns = self.forward_s, self.batch_size, self.batch_started_ns
        for request_id, top, queue_s, enqueued_ns, n in zip(self.request_ids, self.tops, self.queue_s,
                                                             self.enqueued_ns, cached):
            yield request_id, [NextTokenOutput(top, queue_s, forward_s, batch_size, enqueued_ns, started_ns,
                                               cached_tokens=n)]
