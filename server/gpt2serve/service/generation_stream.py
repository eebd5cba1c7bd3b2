"""One generate call as a stream, from the engine's token events to the chunks a transport
sends, as vLLM's RequestState and output processor are: detokenise, cut stop strings, clock,
finish, and tell telemetry.

    engine client ── put(TokenEvent) / fail(error) ──> GenerationStream ── one deque ──> chunks()
    (its TokenSink, on the event loop)                  (detokenise, stop, clock)      (the transport)

A token waits in the deque as (its text, [its SampledToken]); the chunk a caller gets is built
when it takes it, one for all the tokens it takes together, so a reader that is behind costs one
chunk a message, not one a token and then a join.

`chunks()` is what every transport iterates: GenerateChunks, the closing one (finish_reason,
usage, timings) last. The request is checked at the first iteration, so its errors raise before
anything is sent; an error later raises from the iteration where it happened. A caller that
stops iterating (hung up, cancelled, or had enough) cancels the generation, which frees its
KV-cache slot at the next step.

A streaming transport that can send a token's event at once (the HTTP streams) may also
`follow()` the stream: while chunks() waits with nothing queued, a token goes straight to its
`take`, in the engine client's dispatch, with no task woken and no chunk built; whatever take
cannot send (the client's window is full) queues for chunks() as before, joined with what comes
after it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from gpt2serve_client.generation import GeneratedToken, GenerateChunk, GenerateTimings, Usage
from gpt2serve_client.types import PromptTokenLogprob, TokenLogprob

from ..engine.tokenizer import Tokenizer
from ..protocol import NextTokenRequest, SampledToken, TokenEvent
from ..telemetry.records import FirstToken, RequestOptions
from ..telemetry.spans import RequestTelemetry
from .context import CallContext
from .detokenizer import Detokenizer
from .next_token import prompt_token_logprobs
from .step_trace import StepTracer
from .validation import GenerateSettings, PromptInput

T = TypeVar("T")


@dataclass(frozen=True)
class _End:
    """The stream's one end marker: after the closing chunk, or carrying the error that ended it."""

    error: BaseException | None = None


class GenerationStream:
    def __init__(self, service: CallContext, prompt: PromptInput, settings: GenerateSettings,
                 options: RequestOptions):
        self.service, self.prompt, self.settings, self.options = service, prompt, settings, options
        # What chunks() has yet to take: tokens as (text, [SampledToken, ...]), a closing GenerateChunk,
        # a traced step's Future, then _End. A deque and one waiter, not an asyncio.Queue: a token
        # is an append and, when the caller waits, one set_result.
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # chunks(), waiting for an item
        self._cancel: Callable[[], None] = lambda: None  # the engine client's, once started
        self._request: RequestTelemetry | None = None
        self._done = False
        self.token_ids: list[int] = []  # the prompt, once checked
        self._steps: StepTracer | None = None  # with trace_steps
        self._sampled: list[int] = []  # every token sampled so far (with trace_steps)
        self.prompt_logprobs: list[PromptTokenLogprob] = []  # with settings.prompt_logprobs, once the prefill ran
        self.end_token: GeneratedToken | None = None  # the end-of-text or stop token that finished it, if one did
        self.allowed: list[int] = []  # under structured output: the tokens its grammar allowed, each step
        self._interval = 1  # tokens a queued chunk (--stream-interval, for a streaming caller)
        self._held_text: list[str] = []  # tokens not queued yet (interval > 1): their texts
        self._held: list[SampledToken] = []  # and the tokens
        self._take: Callable[[str, list[SampledToken]], bool] | None = None  # follow()'s

    async def chunks(self, coalesce: bool = False) -> AsyncIterator[GenerateChunk]:
        """coalesce (a streaming caller): the tokens that arrived while the caller was busy with
        the last chunk (a transport waiting for a slow reader) come as one chunk
        (GenerateChunk.more_tokens), and so do the tokens of each --stream-interval; with an
        interval of 1, a caller that keeps up gets each token as it comes."""
        if coalesce:
            self._interval = self.service.stream_interval
        await self._start()
        items = self._items
        try:
            while True:
                while not items:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                item = items.popleft()
                if type(item) is tuple:  # a token, or tokens released together
                    text, tokens = joined_with_queued(item, items) if coalesce else item
                    yield token_chunk(self.tokenizer.token_text, text, tokens)
                    continue
                if isinstance(item, asyncio.Future):  # a chunk whose step is being traced
                    item = await item
                if type(item) is _End:
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        except BaseException as exc:  # the caller left (cancelled, or closed the iteration)
            self._end(exc)
            raise

    def follow(self, take: Callable[[str, list[SampledToken]], bool] | None) -> None:
        """From now on (until follow(None)), tokens that arrive while chunks() waits with nothing
        queued go to `take(text, tokens)`, which sends them and says True, or says False: it
        cannot now, so they queue for chunks() instead. Taking them only while chunks() waits
        keeps them in order behind what it has yielded."""
        self._take = take

    def _token(self, text: str, tokens: list[SampledToken]) -> None:
        """Tokens for the caller: to follow()'s take when it can send them now, else queued."""
        take = self._take
        if take is not None and self._waiter is not None and not self._items and take(text, tokens):
            return
        self._push((text, tokens))

    def _push(self, item) -> None:
        """An item for chunks(), which is woken if it waits."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _start(self) -> None:
        service, options = self.service, self.options
        self.clock = StreamClock()  # from the first iteration: a caller may open the stream and start it later
        self._request = request = service.telemetry.start_request(options)
        try:
            engine, _ = service.require_model()
            validator = service.validator
            request.adapter_chosen(validator.adapter(self.settings.adapter))
            prompt = self.token_ids = await validator.prompt(self.prompt, "prompt")
            trace = validator.trace(request, options)
            generate = self.settings.request(prompt, validator.n_ctx, validator.vocab_size, options.deadline, trace,
                                             validator.tokenizer.eos_token_id)
            if options.trace_steps:  # checked before any work
                self._steps = StepTracer(engine, validator.step_trace(request, len(prompt), generate.max_tokens),
                                         request, validator.tokenizer.token_text, generate.params, len(prompt),
                                         generate.adapter)
            request.generation_settings(generate, self.settings.constraint)
            if trace is not None and trace.layer_spans:  # the prompt's forward, layer by layer: a next-token pass of it
                await engine.next_token(NextTokenRequest([prompt], 1, trace, adapter=generate.adapter))
            self.tokenizer: Tokenizer = validator.tokenizer
            self.text = Detokenizer(self.tokenizer, self.settings.stop)
            self._cancel = engine.generate(generate, self)
        except BaseException as exc:
            self._end(exc)
            raise

    # The engine client's side (protocol.TokenSink) ------------------------------------------------

    def put(self, event: TokenEvent) -> None:
        if self._done:
            return
        if self.clock.steps == 0 and self._request is not None:  # the first event: the prefill's
            self._request.prefix_cache_hit(event.cached_tokens)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_token_logprobs(self.tokenizer.token_text, self.token_ids, event.prompt_logprobs)
        if event.token.allowed:
            self.allowed.append(event.token.allowed)
        clock = self.clock
        if clock.step(event.queue_s):
            self.service.telemetry.first_token(FirstToken(self.options.api, self.options.method,
                                                          clock.time_to_first_token_s, self._request.trace_id))
        finish = event.finish_reason
        if finish in ("eos", "stop"):  # the end token is not part of the output
            self.end_token = generated_token(self.tokenizer.token_text, event.token)
            return self._close(finish)
        clock.tokens += 1
        token = event.token
        text = self.text.add(token.token_id)
        if self._steps is not None:
            chunk = GenerateChunk(text, generated_token(self.tokenizer.token_text, token))
            self._push(self._steps.trace_step(clock.steps - 1, self.token_ids + self._sampled, chunk))
            self._sampled.append(token.token_id)
        elif self._interval == 1 or clock.tokens == 1:  # the first token goes at once, whatever the interval
            self._token(text, [token])
        else:  # held, and queued an interval at a time
            self._held_text.append(text)
            self._held.append(token)
            if len(self._held) >= self._interval:
                self._release_held()
        if self.text.stopped:
            self._close("stop")
        elif finish:
            self._close(finish)

    def fail(self, error: Exception) -> None:
        if not self._done:
            self._release_held()  # the tokens generated before the error still reach the caller
            self._push(_End(error))
            self._end(error)

    def _release_held(self) -> None:
        """The tokens held for the interval, queued together."""
        if self._held:
            self._token("".join(self._held_text), self._held)
            self._held_text, self._held = [], []

    # The end, whichever way it comes -----------------------------------------------------------------

    def _close(self, finish: str) -> None:
        """Finished: the closing chunk, then the end marker."""
        clock, prompt, request = self.clock, self.token_ids, self._request
        self._release_held()
        self._items.append(closing_chunk(self.text.finish(), finish, prompt, clock, request.trace_id))
        self._push(_End())
        self._end(None, finish)

    def _end(self, error: BaseException | None, finish: str | None = None) -> None:
        """Once: the engine stops (a no-op if it already has), telemetry hears how it ended."""
        if self._done:
            return
        self._done = True
        self._cancel()
        if self._steps is not None and error is not None:
            self._steps.cancel()
        clock = self.clock
        if self._request is not None:
            self._request.structured_output_steps(self.allowed)
            self._request.finish(error, prompt_tokens=len(self.token_ids), output_tokens=clock.tokens,
                                 time_per_output_token_s=clock.time_per_output_token_s, finish_reason=finish)


def frozen(cls: type[T], fields: dict[str, Any]) -> T:
    """A frozen dataclass made from every one of its fields, without its __init__, which sets each
    field through object.__setattr__: 2.9 µs for a GenerateChunk and 1.5 for a GeneratedToken,
    against 0.7 and 0.5 so, on a path taken once a token per stream. Only for classes without
    __post_init__ or slots; tests/serving/test_coalesced_tokens.py holds the two ways equal."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


# A token's chunk: the fields it never sets (prompt_token_ids and more_tokens get lists of their own).
_TOKEN_CHUNK = {name: getattr(GenerateChunk(), name) for name in GenerateChunk.__dataclass_fields__}


def joined_with_queued(first: tuple[str, list[SampledToken]], items: deque) -> tuple[str, list[SampledToken]]:
    """`first` (a token's text and token, or an interval's) and the tokens queued right behind
    it, taken from `items`, as one text and their tokens; what follows them (a closing chunk, a
    traced step, the end) stays queued, to go next on its own."""
    if not items or type(items[0]) is not tuple:
        return first
    texts, tokens = [first[0]], [*first[1]]
    while items and type(items[0]) is tuple:
        text, more = items.popleft()
        texts.append(text)
        tokens += more
    return "".join(texts), tokens


def token_chunk(token_text: Callable[[int], str], text: str, tokens: list[SampledToken]) -> GenerateChunk:
    """The chunk of one or more tokens: the first in `token`, the others in more_tokens."""
    generated = [generated_token(token_text, token) for token in tokens]
    return frozen(GenerateChunk, dict(_TOKEN_CHUNK, text=text, token=generated[0], more_tokens=generated[1:],
                                      prompt_token_ids=[]))


def generated_token(token_text: Callable[[int], str], token: SampledToken) -> GeneratedToken:
    top = [frozen(TokenLogprob, {"token_id": s.token_id, "token": token_text(s.token_id), "logprob": s.logprob})
           for s in token.top] if token.top else []
    return frozen(GeneratedToken, {"token_id": token.token_id, "token": token_text(token.token_id),
                                   "logprob": token.logprob, "top": top})


@dataclass
class StreamClock:
    """A generation's timings, as its tokens arrive."""

    received: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    first: float | None = None  # the first step's arrival
    last: float = 0.0
    steps: int = 0  # tokens sampled
    tokens: int = 0  # of them, those in the output (not an end-of-text or stop token)

    def step(self, queue_s: float) -> bool:
        """Note a sampled token; True for the first one."""
        self.last = time.perf_counter()
        self.steps += 1
        if self.first is None:
            self.first, self.queue_s = self.last, queue_s
            return True
        return False

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first or self.last) - self.received

    @property
    def time_per_output_token_s(self) -> float | None:
        return (self.last - self.first) / (self.steps - 1) if self.steps > 1 else None

    def timings(self) -> GenerateTimings:
        return GenerateTimings(queue_ms=self.queue_s * 1000, time_to_first_token_ms=self.time_to_first_token_s * 1000,
                               time_per_output_token_ms=(self.time_per_output_token_s or 0.0) * 1000,
                               total_ms=(time.perf_counter() - self.received) * 1000)


def closing_chunk(text: str, finish_reason: str, prompt: list[int], clock: StreamClock, trace_id: str) -> GenerateChunk:
    usage = Usage(len(prompt), clock.tokens, len(prompt) + clock.tokens)
    return GenerateChunk(text, None, finish_reason, usage, clock.timings(), trace_id, prompt)
