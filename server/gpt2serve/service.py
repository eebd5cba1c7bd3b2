"""The inference service both transports call: validate, tokenize, schedule, build results.

Transports only decode their wire format into these calls and encode what comes back, so every
rule about what a valid request is lives here, once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Mapping, Protocol, Sequence

from opentelemetry.context import Context
from opentelemetry.trace import Span

from gpt2serve_client.types import GenerateChunk, ModelInfo, NextTokenResult, Timings, TokenLogprob

from .config import ServeConfig
from .engine.loading import LoadedModel
from .engine.model_info import architecture, parameter_breakdown
from .engine.tokenizer import Tokenizer
from .errors import FailedPrecondition, InvalidArgument, ShuttingDown, Unavailable
from .generating import GenerateSettings, StreamClock, closing_chunk, generated_token
from .scheduling.batcher import ScheduledOutput
from .scheduling.generation import GeneratedStep, GenerationRequest
from .telemetry.spans import RequestTrace, Telemetry, exported_trace_id
from .text_stream import TextStream

DEFAULT_TOP_K = 5
# Longer texts are tokenized in a worker thread, so a 100 KB prompt does not stall the event loop.
TOKENIZE_INLINE_MAX_CHARS = 2048
# attention_maps: n_layer x n_head x T x T floats (GPT-2 small at 128 tokens: 2.4 M, about 10 MB
# of protobuf) and one unembedding per block; beyond this the answer would be unreasonably big.
MAX_ATTENTION_MAP_TOKENS = 128


@dataclass(frozen=True)
class RequestOptions:
    """How a request arrived and what it asked to see; transports fill this in."""

    api: str = "internal"  # "grpc", "rest" or "openai": the metrics label
    method: str = "NextToken"  # "NextToken", "NextTokenBatch", "Generate" or "Completions"
    span_name: str = "next_token"  # "gpt2serve.v1.Gpt2Serve/NextToken", "POST /v1/next-token"
    parent: Context | None = None  # W3C trace context from gRPC metadata or HTTP headers
    attributes: Mapping[str, Any] = field(default_factory=dict)  # rpc.* / http.* span attributes
    trace_layers: bool = False
    include_layers: bool = False
    attention_maps: bool = False  # full attention maps and all-position logit lens (implies include_layers)
    deadline: float | None = None  # time.monotonic() by which the caller gives up (gRPC deadline)

    @property
    def layers_in_response(self) -> bool:
        return self.include_layers or self.attention_maps


class Scheduler(Protocol):
    """Where prompts go to be answered: scheduling.Batcher, or ipc.EngineClient."""

    max_batch_size: int

    async def submit(self, prompts: Sequence[list[int]], top_k: int, trace: Any = None) -> list[ScheduledOutput]: ...


class GenerationScheduler(Protocol):
    """Where generations go: scheduling.generation.GenerationScheduler, or ipc.EngineClient."""

    def generate(self, request: GenerationRequest, trace: Any = None) -> AsyncIterator[GeneratedStep]: ...


def describe_model(loaded: LoadedModel) -> ModelInfo:
    """The model part of ModelInfo; the service fills in its limits when attached."""
    return ModelInfo(
        model=loaded.name, weights=loaded.weights, weights_source=loaded.weights_source,
        dtype=str(loaded.dtype).removeprefix("torch."), device=str(loaded.device),
        architecture=architecture(loaded.model.config), parameters=parameter_breakdown(loaded.model),
        max_prompt_tokens=0, max_batch_size=0,
    )


@dataclass(frozen=True)
class PromptInput:
    """A prompt as it arrives: text or token ids (exactly one of them)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None


class InferenceService:
    """Starts without a model (transports answer UNAVAILABLE / 503 while it loads); `attach` makes it ready."""

    def __init__(self, config: ServeConfig, telemetry: Telemetry | None = None):
        self.config = config
        self.telemetry = telemetry or Telemetry()
        self.max_batch_size = 0  # set by attach(): --max-batch-size, resolved for the device
        self.ready = False
        self.accepting = True  # False once shutdown begins: new requests get UNAVAILABLE.
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._attached: tuple[Scheduler, ModelInfo] | None = None
        self._generation: GenerationScheduler | None = None

    def attach(self, tokenizer: Tokenizer, info: ModelInfo, scheduler: Scheduler,
               generation: GenerationScheduler) -> None:
        """Ready to serve: `info` describes the model (see describe_model), `scheduler` is the
        batcher and `generation` the generation loop, or both are the engine process behind the
        IPC door (ipc.EngineClient)."""
        self._generation = generation
        self.n_ctx, self.vocab_size = info.architecture.n_ctx, info.architecture.vocab_size
        self.max_batch_size = scheduler.max_batch_size
        self.tokenizer = tokenizer
        self.max_prompt_tokens = min(self.config.max_prompt_tokens or self.n_ctx, self.n_ctx)
        # A text of more bytes than this has more tokens than allowed: refuse it without tokenizing.
        self.max_prompt_bytes = self.max_prompt_tokens * tokenizer.max_token_bytes
        info = replace(info, max_prompt_tokens=self.max_prompt_tokens, max_batch_size=self.max_batch_size)
        self._attached = (scheduler, info)
        self.telemetry.model_name, self.telemetry.vocab_size = info.model, self.vocab_size

    def count_refusal(self, api: str, method: str, code: str) -> None:
        """A request refused before it reached the service (auth, size, malformed): count it too."""
        self.telemetry.metrics.request_finished(api, method, code, 0.0)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _require_model(self) -> tuple[Scheduler, ModelInfo]:
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if self._attached is None:
            raise Unavailable("the model is still loading; retry shortly")
        return self._attached

    def model_info(self) -> ModelInfo:
        return self._require_model()[1]

    async def next_token(self, prompt: PromptInput, top_k: int | None = None,
                         options: RequestOptions = RequestOptions()) -> NextTokenResult:
        return (await self.next_token_batch([prompt], top_k, options))[0]

    async def next_token_batch(self, prompts: Sequence[PromptInput], top_k: int | None = None,
                               options: RequestOptions = RequestOptions()) -> list[NextTokenResult]:
        self._started()
        try:
            return await self._next_token_batch(prompts, top_k, options)
        finally:
            self._finished()

    def _started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _finished(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def generate(self, prompt: PromptInput, settings: GenerateSettings = GenerateSettings(),
                       options: RequestOptions = RequestOptions(method="Generate", span_name="generate")
                       ) -> AsyncIterator[GenerateChunk]:
        """The generation's chunks as they come, the closing one last. Errors in the request
        raise at the first iteration, before anything is sent. Leaving the iteration early
        cancels the generation and frees its KV-cache slot."""
        chunks: asyncio.Queue = asyncio.Queue()
        producer = asyncio.create_task(self._generate(prompt, settings, options, chunks.put_nowait))
        try:
            while True:
                item = await chunks.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not producer.done():
                producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def generation_request(self, prompt: PromptInput, settings: GenerateSettings,
                                 deadline: float | None = None) -> GenerationRequest:
        """The prompt tokenized and the settings checked: what `generate` raises for bad input.
        Alone, it refuses a request of several generations whole, before any of them starts."""
        self._require_model()
        token_ids = await self.resolve_prompt(prompt, "prompt")
        return settings.request(token_ids, self.n_ctx, self.vocab_size, deadline)

    async def _generate(self, prompt: PromptInput, settings: GenerateSettings, options: RequestOptions,
                        put: Callable[[Any], None]) -> None:
        """The generation in its own task, so that its request span is current from start to end."""
        self._started()
        try:
            clock = StreamClock()
            with self.telemetry.request_span(options.span_name, options.parent, options.attributes,
                                             options.trace_layers, options.api, options.method,
                                             options.deadline) as span:
                scheduler, _ = self._require_model()
                request = await self.generation_request(prompt, settings, options.deadline)
                token_ids = request.prompt
                trace_id = exported_trace_id(span)
                trace = self.request_trace(span, options, sampled=bool(trace_id))
                for name, value in (("max_tokens", request.max_tokens), ("temperature", request.params.temperature),
                                    ("top_p", request.params.top_p), ("top_k", request.params.top_k)):
                    span.set_attribute(f"gen_ai.request.{name}", value)
                if request.seed is not None:
                    span.set_attribute("gen_ai.request.seed", request.seed)
                if trace.layer_spans:  # the prompt's forward, layer by layer: a next-token pass of it
                    await scheduler.submit([token_ids], 1, trace)
                finish = await self._stream(request, trace, clock, settings.stop, put, trace_id, options)
                span.set_attribute("gen_ai.usage.input_tokens", len(token_ids))
                span.set_attribute("gen_ai.usage.output_tokens", clock.tokens)
                span.set_attribute("gen_ai.response.finish_reasons", [finish.finish_reason])
                metrics = self.telemetry.metrics
                metrics.tokens(options.api, len(token_ids), clock.tokens)
                if clock.time_per_output_token_s is not None:
                    metrics.time_per_output(options.api, clock.time_per_output_token_s, trace_id)
                put(finish)
            put(None)
        except Exception as exc:  # the consumer raises it (errors before the first chunk: a clean status)
            put(exc)
        finally:
            self._finished()

    async def _stream(self, request: GenerationRequest, trace: RequestTrace, clock: StreamClock, stop: Sequence[str],
                      put: Callable[[Any], None], trace_id: str, options: RequestOptions) -> GenerateChunk:
        """Scheduler steps -> chunks (see text_stream); returns the closing chunk."""
        text = TextStream(self.tokenizer, stop)
        steps = self._generation.generate(request, trace)
        finish = "length"
        try:
            async for step in steps:
                if clock.step(step.queue_s):
                    self.telemetry.metrics.first_token(options.api, options.method, clock.time_to_first_token_s,
                                                       trace_id)
                if step.finish_reason in ("eos", "stop"):  # the end token is not part of the output
                    finish = step.finish_reason
                    break
                clock.tokens += 1
                put(GenerateChunk(text.add(step.token.token_id), generated_token(self.tokenizer, step.token)))
                if text.stopped:
                    finish = "stop"
                    break
                if step.finish_reason:
                    finish = step.finish_reason
                    break
        finally:
            await steps.aclose()
        return closing_chunk(text.finish(), finish, request.prompt, clock, trace_id)

    async def _next_token_batch(self, prompts: Sequence[PromptInput], top_k: int | None,
                                options: RequestOptions) -> list[NextTokenResult]:
        received = time.perf_counter()
        with self.telemetry.request_span(options.span_name, options.parent, options.attributes,
                                         options.trace_layers, options.api, options.method, options.deadline) as span:
            scheduler, _ = self._require_model()
            if not prompts:
                raise InvalidArgument("prompts: at least one prompt is required")
            if len(prompts) > self.max_batch_size:
                raise InvalidArgument(
                    f"prompts: {len(prompts)} prompts exceed the limit of {self.max_batch_size} per call")
            k = self.resolve_top_k(top_k)
            token_ids = [await self.resolve_prompt(p, where=f"prompts[{i}]" if len(prompts) > 1 else "prompt")
                         for i, p in enumerate(prompts)]
            longest = max(map(len, token_ids))
            if options.attention_maps and longest > MAX_ATTENTION_MAP_TOKENS:
                raise InvalidArgument(f"attention_maps: the prompt has {longest} tokens; attention maps are "
                                      f"returned for prompts of at most {MAX_ATTENTION_MAP_TOKENS} tokens")
            trace_id = exported_trace_id(span)
            trace = self.request_trace(span, options, sampled=bool(trace_id))
            prompt_tokens = sum(map(len, token_ids))
            span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", len(token_ids))
            span.set_attribute("gen_ai.request.top_k", k)
            outputs = await scheduler.submit(token_ids, k, trace)
            for out in outputs[:1]:  # The prompts of one call enter the queue together.
                self.telemetry.queue_span(span, out.enqueued_ns, out.batch_started_ns)
            metrics = self.telemetry.metrics
            metrics.tokens(options.api, prompt_tokens, len(token_ids))
            for out in outputs:
                metrics.queued(out.queue_s, trace_id)
            total_ms = (time.perf_counter() - received) * 1000
            return [self.build_result(ids, out, total_ms, trace_id, options.layers_in_response)
                    for ids, out in zip(token_ids, outputs)]

    def request_trace(self, span: Span, options: RequestOptions, sampled: bool) -> RequestTrace:
        mode = self.config.trace_layers
        in_response = options.layers_in_response
        if mode == "never" and (options.trace_layers or in_response):
            raise FailedPrecondition("per-layer reports are off on this server (--trace-layers never)")
        layer_spans = sampled and (options.trace_layers or mode == "always")
        return RequestTrace(span.get_span_context(), sampled=sampled,
                            layers_wanted=layer_spans or in_response, layer_spans=layer_spans,
                            layers_in_response=in_response, attention_maps=options.attention_maps)

    def resolve_top_k(self, top_k: int | None) -> int:
        if top_k is None:
            return DEFAULT_TOP_K
        if not 1 <= top_k <= self.vocab_size:
            raise InvalidArgument(f"top_k: {top_k} is outside 1..{self.vocab_size}")
        return top_k

    async def resolve_prompt(self, prompt: PromptInput, where: str) -> list[int]:
        if prompt.text and prompt.token_ids:
            raise InvalidArgument(f"{where}: give prompt text or prompt_token_ids, not both")
        if prompt.token_ids:
            token_ids = list(prompt.token_ids)
            self.check_length(len(token_ids), where)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument(
                    f"{where}: token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}"
                )
        elif prompt.text:
            token_ids = await self.tokenize(prompt.text, where)
        else:
            raise InvalidArgument(f"{where}: the prompt is empty; give prompt text or prompt_token_ids")
        if not token_ids:
            raise InvalidArgument(f"{where}: the prompt encodes to no tokens")
        self.check_length(len(token_ids), where)
        return token_ids

    async def tokenize(self, text: str, where: str) -> list[int]:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\ud800"); UTF-8 cannot.
            raise InvalidArgument(f"{where}: the text is not valid Unicode ({exc.reason} at character {exc.start})")
        if size > self.max_prompt_bytes:
            raise InvalidArgument(f"{where}: {size} bytes of text exceed the limit of {self.max_prompt_tokens} tokens"
                                  f" (--max-prompt-tokens) whatever they encode to")
        if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    def check_length(self, n_tokens: int, where: str) -> None:
        if n_tokens > self.max_prompt_tokens:
            raise InvalidArgument(
                f"{where}: {n_tokens} tokens exceed the limit of {self.max_prompt_tokens} (--max-prompt-tokens)"
            )

    def build_result(self, prompt_token_ids: list[int], out: ScheduledOutput, total_ms: float, trace_id: str,
                     include_layers: bool) -> NextTokenResult:
        top = [TokenLogprob(s.token_id, self.tokenizer.token_text(s.token_id), s.logprob) for s in out.top]
        return NextTokenResult(
            token_id=top[0].token_id, token=top[0].token, logprob=top[0].logprob, top=top,
            prompt_token_ids=prompt_token_ids,
            timings=Timings(queue_ms=out.queue_s * 1000, forward_ms=out.forward_s * 1000, total_ms=total_ms),
            trace_id=trace_id, batch_size=out.batch_size,
            layers=(out.layers or []) if include_layers else [],
            prompt_tokens=[self.tokenizer.token_text(t) for t in prompt_token_ids] if include_layers else [],
        )
