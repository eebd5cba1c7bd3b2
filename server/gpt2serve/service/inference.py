"""The service every transport calls: lifecycle (loading, ready, draining) and the entry points.

Transports only decode their wire format into these calls and encode what comes back, so every
rule about what a valid request is lives in this package, once: validation.py checks,
next_token.py and generation_stream.py run the two kinds of call over the engine client
(protocol.EngineClient: in this process, or the engine process behind IPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import AsyncIterator, Sequence

from gpt2serve_client.generation import GenerateChunk
from gpt2serve_client.types import ModelInfo, NextTokenResult, TokenizeResult

from ..config import ServeConfig
from ..engine.tokenizer import Tokenizer
from ..errors import FailedPrecondition, InvalidArgument, ModelLoading, ShuttingDown
from ..protocol import EngineClient, GenerateRequest
from ..telemetry.records import RequestOptions, RequestRefused
from ..telemetry.spans import Telemetry
from .chat_template import ChatPrompts, resolve_chat_template
from .generation_stream import GenerationStream
from .next_token import next_token_batch
from .validation import GenerateSettings, PromptInput, Validator

GENERATE = RequestOptions(method="Generate", span_name="generate")
# Set for the task of a call its transport took before the drain began: it goes on to its end.
_TAKEN_BEFORE_DRAIN: ContextVar[bool] = ContextVar("gpt2serve_taken_before_drain", default=False)


@dataclass(slots=True)  # not frozen: made per request (see protocol.PER_REQUEST)
class AcceptedCall:
    """A call from the moment its transport took it until its answer was sent (or its caller left)."""

    name: str  # "grpc Generate", "POST /v1/completions"
    since: float  # time.monotonic()

    def describe(self, now: float) -> str:
        return f"{self.name} (taken {now - self.since:.1f} s before)"


class AcceptedScope:
    """InferenceService.accepted's context (a class: a generator-based one cost a REST call
    about 3 µs more)."""

    __slots__ = ("service", "name", "call_id", "taken")

    def __init__(self, service: InferenceService, name: str):
        self.service, self.name = service, name

    def __enter__(self) -> None:
        self.call_id = self.service._call_taken(self.name)
        self.taken = _TAKEN_BEFORE_DRAIN.set(self.service.accepting)

    def __exit__(self, *_) -> None:
        with contextlib.suppress(ValueError):  # an async generator closed from another context
            _TAKEN_BEFORE_DRAIN.reset(self.taken)
        self.service._call_done(self.call_id)


class InferenceService:
    """Starts without a model (transports answer UNAVAILABLE / 503 while it loads); `attach` makes it ready."""

    def __init__(self, config: ServeConfig, telemetry: Telemetry | None = None):
        self.config = config
        self.telemetry = telemetry or Telemetry()
        self.max_batch_size = 0  # set by attach(): --max-batch-size, resolved for the device
        self.stream_interval = config.stream_interval
        self.ready = False
        self.accepting = True  # False once shutdown begins: new requests get UNAVAILABLE.
        self._calls: dict[int, AcceptedCall] = {}  # what the drain waits for
        self._call_ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self._attached: tuple[EngineClient, ModelInfo] | None = None
        self.validator: Validator | None = None
        self.chat: ChatPrompts | None = None

    def attach(self, tokenizer: Tokenizer, info: ModelInfo, engine: EngineClient) -> None:
        """Ready to serve: `info` describes the model (launch.engine_host.describe_model) and
        `engine` is the engine client."""
        n_ctx, vocab_size = info.architecture.n_ctx, info.architecture.vocab_size
        self.max_batch_size = engine.max_batch_size
        self.validator = Validator(tokenizer, n_ctx, vocab_size, self.config.max_prompt_tokens, self.config.trace_layers,
                                   info.adapters)
        self.chat = ChatPrompts(tokenizer, resolve_chat_template(self.config.chat_template, tokenizer))
        info = replace(info, max_prompt_tokens=self.validator.max_prompt_tokens, max_batch_size=self.max_batch_size,
                       chat_completions=self.chat.template is not None, chat_template_source=self.chat.source)
        self._attached = (engine, info)
        self.telemetry.model_name, self.telemetry.vocab_size = info.model, vocab_size

    def count_refusal(self, api: str, method: str, code: str, message: str = "", route: str = "",
                      http_status: int | None = None) -> None:
        """A request refused before it reached the service (auth, size, malformed): counted and logged too."""
        self.telemetry.request_refused(RequestRefused(api, method, code, message, route, http_status))

    def accepted(self, name: str) -> AcceptedScope:
        """A transport holds this from taking a call until its answer is sent: the drain waits
        for it, and a call taken before the drain began is served to its end, whatever it still
        has to do (render a chat template, wait for its turn among n choices, ...)."""
        return AcceptedScope(self, name)

    def _call_taken(self, name: str) -> int:
        call_id = next(self._call_ids)
        self._calls[call_id] = AcceptedCall(name, time.monotonic())
        self._idle.clear()
        return call_id

    def _call_done(self, call_id: int) -> None:
        del self._calls[call_id]
        if not self._calls:
            self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def in_flight_calls(self) -> list[str]:
        """Each call in flight, oldest first, with how long ago it was taken (for the drain's log)."""
        now = time.monotonic()
        return [call.describe(now) for call in sorted(self._calls.values(), key=lambda c: c.since)]

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def require_model(self) -> tuple[EngineClient, ModelInfo]:
        if not self.accepting and not _TAKEN_BEFORE_DRAIN.get():
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if self._attached is None:
            raise ModelLoading("the model is still loading; retry shortly")
        return self._attached

    def model_info(self) -> ModelInfo:
        return self.require_model()[1]

    async def update_adapter(self, name: str, path: str | None) -> list[str]:
        """Load the LoRA adapter at `path` as `name`, or unload `name` (path None), in the engine,
        when --allow-runtime-lora-updating says so; the adapters served after it."""
        engine, _ = self.require_model()
        if not self.config.allow_runtime_lora_updating:
            raise FailedPrecondition("loading and unloading LoRA adapters while serving is off: start the server "
                                     "with --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
        if not name:
            raise InvalidArgument("lora_name: an adapter needs a name", param="lora_name")
        if path is not None and not path:
            raise InvalidArgument("lora_path: the adapter's directory is needed", param="lora_path")
        if name == self.model_info().model:
            raise InvalidArgument(f"lora_name: {name!r} is the base model's name", param="lora_name")
        names = await engine.update_adapter(name, path)
        self.adapters_changed(names)
        return names

    def adapters_changed(self, names: list[str]) -> None:
        """The engine serves these adapters now: requests are checked against them, and listed."""
        engine, info = self.require_model()
        self.validator.adapters = tuple(names)
        self._attached = (engine, replace(info, adapters=list(names)))

    async def next_token(self, prompt: PromptInput, top_k: int | None = None,
                         options: RequestOptions = RequestOptions(),
                         prompt_logprobs: int | None = None, adapter: str | None = None) -> NextTokenResult:
        return (await self.next_token_batch([prompt], top_k, options, prompt_logprobs, adapter))[0]

    async def next_token_batch(self, prompts: Sequence[PromptInput], top_k: int | None = None,
                               options: RequestOptions = RequestOptions(),
                               prompt_logprobs: int | None = None, adapter: str | None = None) -> list[NextTokenResult]:
        """`prompt_logprobs`: also score every prompt token, with that many alternatives each;
        `adapter`: under that LoRA adapter (ModelInfo.adapters), None: the base."""
        return await next_token_batch(self, prompts, top_k, options, prompt_logprobs, adapter)

    def generate(self, prompt: PromptInput, settings: GenerateSettings = GenerateSettings(),
                 options: RequestOptions = GENERATE, coalesce: bool = False) -> AsyncIterator[GenerateChunk]:
        """The generation's chunks as they come, the closing one last (see generation_stream);
        coalesce: tokens a slow reader has not taken yet come together, as one chunk."""
        return GenerationStream(self, prompt, settings, options).chunks(coalesce)

    def generation_stream(self, prompt: PromptInput, settings: GenerateSettings = GenerateSettings(),
                          options: RequestOptions = GENERATE) -> GenerationStream:
        """The stream object itself: its chunks(), and what it learns besides (the scored prompt)."""
        return GenerationStream(self, prompt, settings, options)

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """A conversation's prompt tokens, through the chat template (service.chat_template)."""
        self.require_model()
        token_ids = await self.chat.prompt(messages, add_generation_prompt, continue_final_message, template_kwargs)
        if not token_ids:
            raise InvalidArgument("messages: the chat template rendered them to no tokens", param="messages")
        try:
            self.validator.check_length(len(token_ids), "messages")
        except InvalidArgument as exc:
            raise InvalidArgument(f"{exc.message} once rendered by the chat template", param="messages") from None
        return token_ids

    async def tokenize(self, text: str | None, messages: list[dict] | None = None, add_generation_prompt: bool = True,
                       token_strs: bool = False) -> TokenizeResult:
        """A text's tokens, or a conversation's through the chat template as chat renders it, and
        the longest prompt this server takes. No length limit applies: counting a prompt before
        sending it is what this is for. `token_strs`: each token's own text too."""
        _, info = self.require_model()
        if messages is not None:
            if text:
                raise InvalidArgument("give prompt or messages, not both")
            if not messages:
                raise InvalidArgument("messages: at least one message is needed", param="messages")
            tokens = await self.chat.prompt(messages, add_generation_prompt, False, None)
        else:
            tokens = await self.validator.tokenize(text or "", "prompt")
        texts = [self.validator.tokenizer.token_text(t) for t in tokens] if token_strs else None
        return TokenizeResult(tokens, len(tokens), info.max_prompt_tokens, texts)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self.require_model()
        vocab_size = self.validator.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"tokens: {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}", param="tokens")
        return self.validator.tokenizer.decode(list(token_ids))

    async def generation_request(self, prompt: PromptInput, settings: GenerateSettings) -> GenerateRequest:
        """The prompt tokenized and the settings checked: what `generate` raises for bad input.
        Alone, it refuses a request of several generations whole, before any of them starts."""
        self.require_model()
        self.validator.adapter(settings.adapter)
        token_ids = await self.validator.prompt(prompt, "prompt")
        return settings.request(token_ids, self.validator.n_ctx, self.validator.vocab_size,
                                eos_token_id=self.validator.tokenizer.eos_token_id)
