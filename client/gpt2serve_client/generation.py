"""Typed generation results shared by the clients and the server: a token, a streamed chunk, a
whole generation, and (with trace_steps) how each token was chosen. Each converts to and from its
protobuf message and its REST JSON form, as the types in `types` do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ._proto import gpt2serve_pb2 as pb
from .types import ShapeStep, TokenLogprob, TokenProb, _fields_of


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token; `logprob` and `top` are under the model's own distribution."""

    token_id: int
    token: str
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)

    def to_proto(self) -> pb.GeneratedToken:
        if not self.top:
            return pb.GeneratedToken(token_id=self.token_id, token=self.token, logprob=self.logprob)
        return pb.GeneratedToken(token_id=self.token_id, token=self.token, logprob=self.logprob,
                                 top=[t.to_proto() for t in self.top])

    @classmethod
    def from_proto(cls, msg: pb.GeneratedToken) -> GeneratedToken:
        return cls(msg.token_id, msg.token, msg.logprob, [TokenLogprob.from_proto(t) for t in msg.top])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedToken:
        return cls(data["token_id"], data["token"], data["logprob"],
                   [TokenLogprob.from_dict(t) for t in data.get("top") or []])

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "token": self.token, "logprob": self.logprob,
                "top": [t.to_dict() for t in self.top]}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class GenerateTimings:
    queue_ms: float = 0.0  # waiting for a KV-cache slot
    time_to_first_token_ms: float = 0.0
    time_per_output_token_ms: float = 0.0  # mean between tokens after the first
    total_ms: float = 0.0


@dataclass(frozen=True)
class GenerationStep:
    """How the model chose one generated token (trace_steps). Step 0 is the prefill (the prompt's
    forward); each later step is the previous token's row alone, attending over the KV cache.
    `attention` is the new row's attention over the cache, [n_layer, n_head, context_tokens]."""

    index: int
    position: int
    context_tokens: int
    new_row_shape: list[int]
    kv_cache_shape: list[int]
    attention: list[float]
    logit_lens: list[TokenProb]
    top: list[TokenLogprob]
    walkthrough: list[ShapeStep]
    n_layer: int
    n_head: int
    token_id: int
    token: str
    new_tokens: list[str] = field(default_factory=list)  # the rows this step computed, as text
    # With sampling controls (penalties, logit_bias, min_tokens, structured output): the top
    # tokens after them (temperature 1, only those left possible), and how many they left
    # possible (under a grammar, the tokens it allowed). Empty and 0 without controls.
    controlled_top: list[TokenLogprob] = field(default_factory=list)
    allowed_tokens: int = 0

    def attention_row(self, layer: int, head: int) -> list[float]:
        """One head's attention over the cache at this step, [context_tokens]."""
        start = (layer * self.n_head + head) * self.context_tokens
        return self.attention[start:start + self.context_tokens]

    def to_proto(self) -> pb.GenerationStep:
        data = asdict(self)
        return pb.GenerationStep(**{**data, "logit_lens": [pb.TokenProb(**t) for t in data["logit_lens"]],
                                    "top": [t.to_proto() for t in self.top],
                                    "controlled_top": [t.to_proto() for t in self.controlled_top],
                                    "walkthrough": [s.to_proto() for s in self.walkthrough]})

    @classmethod
    def from_proto(cls, msg: pb.GenerationStep) -> GenerationStep:
        data = _fields_of(cls, lambda name: getattr(msg, name))
        data.update(new_row_shape=list(msg.new_row_shape), kv_cache_shape=list(msg.kv_cache_shape),
                    attention=list(msg.attention), new_tokens=list(msg.new_tokens),
                    logit_lens=[TokenProb(**_fields_of(TokenProb, lambda n, t=t: getattr(t, n))) for t in msg.logit_lens],
                    top=[TokenLogprob.from_proto(t) for t in msg.top],
                    controlled_top=[TokenLogprob.from_proto(t) for t in msg.controlled_top],
                    walkthrough=[ShapeStep.from_proto(s) for s in msg.walkthrough])
        return cls(**data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationStep:
        return cls(**{**data, "logit_lens": [TokenProb(**t) for t in data["logit_lens"]],
                      "top": [TokenLogprob.from_dict(t) for t in data["top"]],
                      "controlled_top": [TokenLogprob.from_dict(t) for t in data.get("controlled_top", [])],
                      "walkthrough": [ShapeStep.from_dict(s) for s in data["walkthrough"]]})


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: a token and the output text it adds (text that may begin a stop
    string or an incomplete character is held back, so the texts add up to the output), or the
    closing message (`token` None) with `finish_reason`, `usage` and `timings`."""

    text: str = ""
    token: GeneratedToken | None = None
    finish_reason: str = ""  # "length" | "stop" | "eos", closing message only
    usage: Usage | None = None
    timings: GenerateTimings | None = None
    trace_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    step: GenerationStep | None = None  # with trace_steps: how the model chose `token`
    # Tokens after `token` in the same message, sent together because the reader had not read
    # the ones before; `text` is theirs too. The clients split such a message (split()).
    more_tokens: list[GeneratedToken] = field(default_factory=list)

    def to_proto(self) -> pb.GenerateResponse:
        if self.token is not None and not (self.finish_reason or self.usage or self.timings or self.trace_id
                                           or self.prompt_token_ids or self.step):  # a token's message: the hot path
            if self.more_tokens:
                return pb.GenerateResponse(text=self.text, token=self.token.to_proto(),
                                           more_tokens=[t.to_proto() for t in self.more_tokens])
            return pb.GenerateResponse(text=self.text, token=self.token.to_proto())
        return pb.GenerateResponse(
            text=self.text, token=self.token.to_proto() if self.token else None, finish_reason=self.finish_reason,
            usage=pb.Usage(**asdict(self.usage)) if self.usage else None,
            timings=pb.GenerateTimings(**asdict(self.timings)) if self.timings else None,
            trace_id=self.trace_id, prompt_token_ids=self.prompt_token_ids,
            step=self.step.to_proto() if self.step else None,
        )

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> GenerateChunk:
        return cls(
            text=msg.text, token=GeneratedToken.from_proto(msg.token) if msg.HasField("token") else None,
            finish_reason=msg.finish_reason,
            usage=Usage(**_fields_of(Usage, lambda n: getattr(msg.usage, n))) if msg.HasField("usage") else None,
            timings=GenerateTimings(**_fields_of(GenerateTimings, lambda n: getattr(msg.timings, n)))
            if msg.HasField("timings") else None,
            trace_id=msg.trace_id, prompt_token_ids=list(msg.prompt_token_ids),
            step=GenerationStep.from_proto(msg.step) if msg.HasField("step") else None,
            more_tokens=[GeneratedToken.from_proto(t) for t in msg.more_tokens],
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateChunk:
        return cls(
            text=data.get("text", ""), token=GeneratedToken.from_dict(data["token"]) if data.get("token") else None,
            finish_reason=data.get("finish_reason", ""),
            usage=Usage(**data["usage"]) if data.get("usage") else None,
            timings=GenerateTimings(**data["timings"]) if data.get("timings") else None,
            trace_id=data.get("trace_id", ""), prompt_token_ids=list(data.get("prompt_token_ids") or []),
            step=GenerationStep.from_dict(data["step"]) if data.get("step") else None,
            more_tokens=[GeneratedToken.from_dict(t) for t in data.get("more_tokens") or []],
        )

    def to_dict(self) -> dict[str, Any]:
        """As dataclasses.asdict (the REST stream's event), without its deep copy on a token's message."""
        if self.step is not None or self.usage is not None or self.timings is not None:
            return asdict(self)
        return {"text": self.text, "token": self.token.to_dict() if self.token is not None else None,
                "finish_reason": self.finish_reason, "usage": None, "timings": None, "trace_id": self.trace_id,
                "prompt_token_ids": list(self.prompt_token_ids), "step": None,
                "more_tokens": [t.to_dict() for t in self.more_tokens]}

    def split(self) -> list[GenerateChunk]:
        """One chunk per token, as a reader that kept up would have had them: this one with the
        whole text and its first token, then one per further token with no text of its own."""
        if not self.more_tokens:
            return [self]
        return [replace(self, more_tokens=[]), *(GenerateChunk(token=token) for token in self.more_tokens)]


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation: the text, its tokens, why it ended, and what it cost."""

    text: str
    tokens: list[GeneratedToken]
    finish_reason: str
    usage: Usage
    timings: GenerateTimings = field(default_factory=GenerateTimings)
    trace_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    steps: list[GenerationStep] = field(default_factory=list)  # with trace_steps: one per token

    @classmethod
    def from_chunks(cls, chunks) -> GenerateResult:
        """Gather a stream of GenerateChunk (the last one closes it)."""
        text, tokens, steps, last = [], [], [], GenerateChunk()
        for chunk in chunks:
            text.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
            tokens += chunk.more_tokens
            if chunk.step is not None:
                steps.append(chunk.step)
            last = chunk
        return cls("".join(text), tokens, last.finish_reason, last.usage or Usage(), last.timings or GenerateTimings(),
                   last.trace_id, last.prompt_token_ids, steps)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateResult:
        return cls(data["text"], [GeneratedToken.from_dict(t) for t in data["tokens"]], data["finish_reason"],
                   Usage(**data["usage"]), GenerateTimings(**data.get("timings") or {}), data.get("trace_id", ""),
                   list(data.get("prompt_token_ids") or []),
                   [GenerationStep.from_dict(s) for s in data.get("steps") or []])
