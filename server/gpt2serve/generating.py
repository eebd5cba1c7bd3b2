"""What a generate call asks for, checked once for every transport, and its answer built from steps.

The service (service.InferenceService.generate) runs the call; this module holds its rules:
which settings are valid, and how scheduler steps become streamed chunks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from gpt2serve_client.types import GeneratedToken, GenerateChunk, GenerateTimings, TokenLogprob, Usage

from .engine.generation import SampledToken
from .engine.sampling import SamplingParams
from .engine.tokenizer import Tokenizer
from .errors import InvalidArgument
from .scheduling.generation import GenerationRequest

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 100.0


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

    def request(self, prompt: list[int], n_ctx: int, vocab_size: int, deadline: float | None) -> GenerationRequest:
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
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, none empty")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"stop_token_ids: {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise InvalidArgument("seed: must fit in 64 bits")
        return GenerationRequest(prompt, SamplingParams(temperature, top_k, top_p, self.logprobs), max_tokens,
                                 frozenset(self.stop_token_ids), self.ignore_eos, self.seed, deadline)


def generated_token(tokenizer: Tokenizer, token: SampledToken) -> GeneratedToken:
    top = [TokenLogprob(s.token_id, tokenizer.token_text(s.token_id), s.logprob) for s in token.top]
    return GeneratedToken(token.token_id, tokenizer.token_text(token.token_id), token.logprob, top)


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
