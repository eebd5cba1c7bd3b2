"""What makes a request valid, checked once for every transport: prompts, top-k, generate
settings and the per-layer reports a request may ask for. A bad value is INVALID_ARGUMENT (or
FAILED_PRECONDITION for a feature this server has switched off) naming the field at fault."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..engine.grammar_check import grammar_for
from ..engine.tokenizer import Tokenizer
from ..errors import FailedPrecondition, InvalidArgument, NotFound
from ..protocol import GenerateRequest, SamplingParams, TraceContext
from ..telemetry.records import RequestOptions
from ..telemetry.spans import RequestTelemetry

DEFAULT_TOP_K = 5
# Longer texts are tokenized in a worker thread, so a 100 KB prompt does not stall the event loop.
TOKENIZE_INLINE_MAX_CHARS = 2048
# attention_maps: n_layer x n_head x T x T floats (GPT-2 small at 128 tokens: 2.4 M, about 10 MB
# of protobuf) and one unembedding per block; beyond this the answer would be unreasonably big.
MAX_ATTENTION_MAP_TOKENS = 128
DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, -100..100
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class GenerateSettings:
    """A generate call's parameters as the caller gave them (None: the default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # also score the prompt in the prefill, with this many alternatives
    # The controls on the logits (engine.logits_controls has the formulas).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    # Structured output: (kind, spec, the field it came from); kinds: engine.grammar_check.grammar_for.
    constraint: tuple[str, str, str] | None = None
    adapter: str | None = None  # a LoRA adapter's name (checked by Validator.adapter); None: the base

    def request(self, prompt: list[int], n_ctx: int, vocab_size: int, deadline: float | None = None,
                trace: TraceContext | None = None, eos_token_id: int | None = None) -> GenerateRequest:
        """Checked against the model; a bad value is INVALID_ARGUMENT naming the field."""
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens: {max_tokens} must be at least 1")
        if len(prompt) + max_tokens > n_ctx:
            raise InvalidArgument(f"max_tokens: the prompt's {len(prompt)} tokens plus max_tokens {max_tokens} exceed "
                                  f"the model's context of {n_ctx} tokens")
        temperature = 1.0 if self.temperature is None else self.temperature
        if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"temperature: {temperature} is outside 0..{MAX_TEMPERATURE:g} (0: greedy)")
        top_k = self.top_k or 0
        if not 0 <= top_k <= vocab_size:
            raise InvalidArgument(f"top_k: {top_k} is outside 0..{vocab_size} (0: no limit)")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidArgument(f"top_p: {top_p} must be within (0, 1]")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs: {self.logprobs} is outside 0..{MAX_LOGPROBS}")
        Validator.prompt_logprobs(self.prompt_logprobs)
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, none empty")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"stop_token_ids: {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise InvalidArgument("seed: must fit in 64 bits")
        params = SamplingParams(temperature, top_k, top_p, self.logprobs,
                                **self.controls(vocab_size, max_tokens, eos_token_id))
        return GenerateRequest(prompt, params, max_tokens, frozenset(self.stop_token_ids), self.ignore_eos, self.seed,
                               deadline, trace, self.prompt_logprobs, self.adapter)

    def controls(self, vocab_size: int, max_tokens: int, eos_token_id: int | None) -> dict:
        """The logits controls as SamplingParams fields, each checked (ranges as OpenAI's and vLLM's)."""
        def within(name: str, value: float | None, default: float, low: float, high: float, low_open=False) -> float:
            value = default if value is None else value
            if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
                raise InvalidArgument(f"{name}: {value} is outside {'(' if low_open else '['}{low:g}, {high:g}]",
                                      param=name)
            return float(value)

        bias = []
        for token, value in (self.logit_bias or {}).items():
            if not 0 <= token < vocab_size:
                raise InvalidArgument(f"logit_bias: token {token} is outside the vocabulary 0..{vocab_size - 1}",
                                      param="logit_bias")
            bias.append((token, within("logit_bias", value, 0.0, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
        min_tokens = self.min_tokens or 0
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidArgument(f"min_tokens: {min_tokens} is outside 0..max_tokens ({max_tokens})",
                                  param="min_tokens")
        early = set(self.stop_token_ids) | ({eos_token_id} if eos_token_id is not None and not self.ignore_eos else set())
        grammar = ""
        if self.constraint is not None:
            kind, spec, field = self.constraint
            for name, clash in (("ignore_eos", self.ignore_eos), ("min_tokens", min_tokens)):
                if clash:
                    raise InvalidArgument(f"{name}: not with {field} (the end of text closes a structured output)",
                                          param=name)
            grammar = grammar_for(kind, spec, field)
        return dict(presence_penalty=within("presence_penalty", self.presence_penalty, 0.0, -2.0, 2.0),
                    frequency_penalty=within("frequency_penalty", self.frequency_penalty, 0.0, -2.0, 2.0),
                    repetition_penalty=within("repetition_penalty", self.repetition_penalty, 1.0, 0.0,
                                              MAX_REPETITION_PENALTY, low_open=True),
                    logit_bias=tuple(sorted(bias)), min_p=within("min_p", self.min_p, 0.0, 0.0, 1.0),
                    min_tokens=min_tokens, banned_early=tuple(sorted(early)) if min_tokens else (), grammar=grammar)


def one_constraint(given: list[tuple[str, str, str]]) -> tuple[str, str, str] | None:
    """The structured output a request asked for (GenerateSettings.constraint): at most one of
    the (kind, spec, field) it gave."""
    if len(given) > 1:
        field = given[1][2]
        raise InvalidArgument(f"{field}: one structured output a request, and {given[0][2]} is one",
                              param=field.split(".")[0])
    return given[0] if given else None


@dataclass(slots=True)  # not frozen: made per request (see protocol.PER_REQUEST)
class PromptInput:
    """A prompt as it arrives: text or token ids (exactly one of them)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None


class Validator:
    """The model-dependent rules: set up by InferenceService.attach once the model is known."""

    def __init__(self, tokenizer: Tokenizer, n_ctx: int, vocab_size: int, max_prompt_tokens: int | None,
                 trace_layers_mode: str, adapters: Sequence[str] = ()):
        self.tokenizer, self.n_ctx, self.vocab_size, self.adapters = tokenizer, n_ctx, vocab_size, tuple(adapters)
        self.max_prompt_tokens = min(max_prompt_tokens or n_ctx, n_ctx)
        # A text of more bytes than this has more tokens than allowed: refuse it without tokenizing.
        self.max_prompt_bytes = self.max_prompt_tokens * tokenizer.max_token_bytes
        self.trace_layers_mode = trace_layers_mode  # --trace-layers: never, sampled or always

    def top_k(self, top_k: int | None) -> int:
        if top_k is None:
            return DEFAULT_TOP_K
        if not 1 <= top_k <= self.vocab_size:
            raise InvalidArgument(f"top_k: {top_k} is outside 1..{self.vocab_size}")
        return top_k

    def adapter(self, name: str | None) -> str | None:
        """The LoRA adapter a request names: None or "" for the base, else one this server serves (NotFound)."""
        if not name:
            return None
        if name not in self.adapters:
            served = ", ".join(self.adapters) or "none"
            raise NotFound(f"adapter: the LoRA adapter {name!r} is not served here (served: {served})", param="adapter")
        return name

    @staticmethod
    def prompt_logprobs(k: int | None, where: str = "prompt_logprobs") -> int | None:
        """Alternatives per scored prompt position (None: the prompt is not scored)."""
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise InvalidArgument(f"{where}: {k} is outside 0..{MAX_LOGPROBS}")
        return k

    async def prompt(self, prompt: PromptInput, where: str) -> list[int]:
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

    def step_trace(self, request: RequestTelemetry, prompt_tokens: int, max_tokens: int) -> TraceContext:
        """What each traced generation step asks of its forward (service.step_trace): the layer
        reports with attention maps, in the response only (no spans of its own)."""
        if self.trace_layers_mode == "never":
            raise FailedPrecondition("trace_steps: per-layer reports are off on this server (--trace-layers never)")
        if prompt_tokens + max_tokens > MAX_ATTENTION_MAP_TOKENS:
            raise InvalidArgument(f"trace_steps: the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} "
                                  f"exceed the {MAX_ATTENTION_MAP_TOKENS} tokens a traced generation may hold")
        return TraceContext(request.traceparent, layers_wanted=True, layers_in_response=True,
                            attention_maps=True, last_row_maps=True)

    def trace(self, request: RequestTelemetry, options: RequestOptions) -> TraceContext | None:
        """What the engine side is to record for this request (per-layer reports, spans); None
        when nothing: the request is not sampled and wants no layers (most, and the cheapest)."""
        in_response = options.layers_in_response
        if self.trace_layers_mode == "never" and (options.trace_layers or in_response):
            raise FailedPrecondition("per-layer reports are off on this server (--trace-layers never)")
        sampled = bool(request.trace_id)
        if not sampled and not in_response:
            return None
        layer_spans = sampled and (options.trace_layers or self.trace_layers_mode == "always")
        return TraceContext(request.traceparent, sampled=sampled, layers_wanted=layer_spans or in_response,
                            layer_spans=layer_spans, layers_in_response=in_response,
                            attention_maps=options.attention_maps, compare_base=options.compare_base)
