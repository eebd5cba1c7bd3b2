"""Typed results shared by the clients and the server (which builds responses from them).

Each type converts to and from its protobuf message and its REST JSON form (snake_case
fields that mirror the proto).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ._proto import gpt2serve_pb2 as pb


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float

    def to_proto(self) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=self.token_id, token=self.token, logprob=self.logprob)

    @classmethod
    def from_proto(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        return cls(token_id=msg.token_id, token=msg.token, logprob=msg.logprob)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenLogprob:
        return cls(token_id=data["token_id"], token=data["token"], logprob=data["logprob"])

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "token": self.token, "logprob": self.logprob}


@dataclass(frozen=True)
class Timings:
    queue_ms: float = 0.0
    forward_ms: float = 0.0
    total_ms: float = 0.0

    def to_proto(self) -> pb.Timings:
        return pb.Timings(queue_ms=self.queue_ms, forward_ms=self.forward_ms, total_ms=self.total_ms)

    @classmethod
    def from_proto(cls, msg: pb.Timings) -> Timings:
        return cls(queue_ms=msg.queue_ms, forward_ms=msg.forward_ms, total_ms=msg.total_ms)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timings:
        return cls(**{k: data.get(k, 0.0) for k in ("queue_ms", "forward_ms", "total_ms")})

    def to_dict(self) -> dict[str, Any]:
        return {"queue_ms": self.queue_ms, "forward_ms": self.forward_ms, "total_ms": self.total_ms}


def _fields_of(cls, get) -> dict[str, Any]:
    """Scalar and list fields of a flat dataclass, read from a message or a dict via `get`."""
    return {name: get(name) for name in cls.__dataclass_fields__}


@dataclass(frozen=True)
class TokenProb:
    token_id: int
    token: str
    prob: float


@dataclass(frozen=True)
class HeadSummary:
    """One attention head, seen from the prompt's last position (definitions: docs/tracing.md)."""

    entropy: float
    max_weight: float
    top_position: int
    top_token_id: int
    top_token: str
    first_token_weight: float
    previous_token_score: float


BASE_SHIFT_FIELDS = ("base_residual_shift", "base_attn_shift", "base_mlp_shift")  # optional: None unless compare_base
SHAPE_FIELDS = ("batch_hidden_shape", "batch_qkv_shape", "batch_attn_shape", "batch_mlp_shape",
                "hidden_shape", "qkv_shape", "attn_shape", "mlp_shape")


@dataclass(frozen=True)
class LayerReport:
    """What one transformer block did to this prompt: shapes, per-head attention, norms, logit lens."""

    index: int
    batch_hidden_shape: list[int]
    batch_qkv_shape: list[int]
    batch_attn_shape: list[int]
    batch_mlp_shape: list[int]
    hidden_shape: list[int]
    qkv_shape: list[int]
    attn_shape: list[int]
    mlp_shape: list[int]
    heads: list[HeadSummary]
    residual_norm: float
    attn_output_norm: float
    mlp_output_norm: float
    logit_lens: list[TokenProb]
    duration_ms: float
    # With attention_maps: every head's attention over the prompt, [H, T, T] flattened row-major
    # (see `attention_map`), and the top token after this block at every position [T].
    attention: list[float] = field(default_factory=list)
    logit_lens_positions: list[TokenProb] = field(default_factory=list)
    # With compare_base (a prompt under a LoRA adapter): the same prompt through the base model in
    # the same forward. How far the adapter moved this block at the last position, as
    # ||adapter - base|| / ||base||: the residual stream after the block (everything so far) and
    # the block's own attention and MLP outputs; and the base's logit lens beside `logit_lens`.
    base_residual_shift: float | None = None
    base_attn_shift: float | None = None
    base_mlp_shift: float | None = None
    base_logit_lens: list[TokenProb] = field(default_factory=list)

    def attention_map(self, head: int) -> list[list[float]]:
        """One head's [T, T] attention pattern (query rows, key columns)."""
        n_head, length = self.attn_shape[0], self.attn_shape[-1]
        start = head * length * length
        if not self.attention or not 0 <= head < n_head:
            return []
        return [self.attention[start + row * length:start + (row + 1) * length] for row in range(length)]

    def to_proto(self) -> pb.LayerReport:
        data = asdict(self)
        return pb.LayerReport(**{**data, "heads": [pb.HeadSummary(**h) for h in data["heads"]],
                                 "logit_lens": [pb.TokenProb(**t) for t in data["logit_lens"]],
                                 "logit_lens_positions": [pb.TokenProb(**t) for t in data["logit_lens_positions"]],
                                 "base_logit_lens": [pb.TokenProb(**t) for t in data["base_logit_lens"]]})

    @classmethod
    def from_proto(cls, msg: pb.LayerReport) -> LayerReport:
        data = _fields_of(cls, lambda name: getattr(msg, name))
        data.update({name: list(data[name]) for name in SHAPE_FIELDS})
        data["heads"] = [HeadSummary(**_fields_of(HeadSummary, lambda n, h=h: getattr(h, n))) for h in msg.heads]
        data["attention"] = list(msg.attention)
        for name in ("logit_lens", "logit_lens_positions", "base_logit_lens"):
            data[name] = [TokenProb(**_fields_of(TokenProb, lambda n, t=t: getattr(t, n))) for t in getattr(msg, name)]
        for name in BASE_SHIFT_FIELDS:
            data[name] = getattr(msg, name) if msg.HasField(name) else None
        return cls(**data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerReport:
        return cls(**{**data, "heads": [HeadSummary(**h) for h in data["heads"]],
                      "logit_lens": [TokenProb(**t) for t in data["logit_lens"]],
                      "logit_lens_positions": [TokenProb(**t) for t in data.get("logit_lens_positions", [])],
                      "base_logit_lens": [TokenProb(**t) for t in data.get("base_logit_lens", [])]})


@dataclass(frozen=True)
class ShapeStep:
    """One matrix of the shape walk-through: data the forward computed or a weight ("kind"), with
    its real shape (weights as [in, out]); "stage" is input, block (every block alike) or output."""

    stage: str
    name: str
    kind: str
    shape: list[int]
    note: str = ""

    def to_proto(self) -> pb.ShapeStep:
        return pb.ShapeStep(**asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.ShapeStep) -> ShapeStep:
        return cls(stage=msg.stage, name=msg.name, kind=msg.kind, shape=list(msg.shape), note=msg.note)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapeStep:
        return cls(**{**data, "shape": list(data["shape"])})


@dataclass(frozen=True)
class PromptTokenLogprob:
    """One prompt token, scored: how likely the model found it after the tokens before it.
    The first token has nothing before it: `logprob` and `rank` are None."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None  # 1 + the tokens the model found more likely (1: its top choice)
    top: list[TokenLogprob] = field(default_factory=list)  # most likely first

    def to_proto(self) -> pb.PromptTokenLogprob:
        return pb.PromptTokenLogprob(token_id=self.token_id, token=self.token, logprob=self.logprob, rank=self.rank,
                                     top=[t.to_proto() for t in self.top])

    @classmethod
    def from_proto(cls, msg: pb.PromptTokenLogprob) -> PromptTokenLogprob:
        return cls(token_id=msg.token_id, token=msg.token,
                   logprob=msg.logprob if msg.HasField("logprob") else None,
                   rank=msg.rank if msg.HasField("rank") else None,
                   top=[TokenLogprob.from_proto(t) for t in msg.top])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptTokenLogprob:
        return cls(token_id=data["token_id"], token=data["token"], logprob=data.get("logprob"),
                   rank=data.get("rank"), top=[TokenLogprob.from_dict(t) for t in data.get("top") or []])


def perplexity(prompt_logprobs: list[PromptTokenLogprob]) -> float:
    """exp of the mean negative log-probability over the scored tokens (every one but the first)."""
    scored = [p.logprob for p in prompt_logprobs if p.logprob is not None]
    return math.exp(-sum(scored) / len(scored)) if scored else float("nan")


@dataclass(frozen=True)
class NextTokenResult:
    """The most likely next token (`token`, `token_id`, `logprob`) and the top-k list."""

    token_id: int
    token: str
    logprob: float
    top: list[TokenLogprob]
    prompt_token_ids: list[int]
    timings: Timings = field(default_factory=Timings)
    trace_id: str = ""
    batch_size: int = 1
    layers: list[LayerReport] = field(default_factory=list)
    prompt_tokens: list[str] = field(default_factory=list)  # with the layers: each prompt token as text
    walkthrough: list[ShapeStep] = field(default_factory=list)  # with the layers: the forward's shapes
    # With prompt_logprobs: one entry per prompt token (the first has no logprob).
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    # With compare_base: the base model's top-k for the same prompt, beside `top` (the adapter's).
    base_top: list[TokenLogprob] = field(default_factory=list)

    def to_proto(self) -> pb.NextTokenResponse:
        return pb.NextTokenResponse(
            token_id=self.token_id, token=self.token, logprob=self.logprob,
            top=[t.to_proto() for t in self.top], prompt_token_ids=self.prompt_token_ids,
            timings=self.timings.to_proto(), trace_id=self.trace_id, batch_size=self.batch_size,
            layers=[layer.to_proto() for layer in self.layers], prompt_tokens=self.prompt_tokens,
            walkthrough=[step.to_proto() for step in self.walkthrough],
            prompt_logprobs=[p.to_proto() for p in self.prompt_logprobs],
            base_top=[t.to_proto() for t in self.base_top],
        )

    @classmethod
    def from_proto(cls, msg: pb.NextTokenResponse) -> NextTokenResult:
        return cls(
            token_id=msg.token_id, token=msg.token, logprob=msg.logprob,
            top=[TokenLogprob.from_proto(t) for t in msg.top],
            prompt_token_ids=list(msg.prompt_token_ids), timings=Timings.from_proto(msg.timings),
            trace_id=msg.trace_id, batch_size=msg.batch_size,
            layers=[LayerReport.from_proto(layer) for layer in msg.layers], prompt_tokens=list(msg.prompt_tokens),
            walkthrough=[ShapeStep.from_proto(step) for step in msg.walkthrough],
            prompt_logprobs=[PromptTokenLogprob.from_proto(p) for p in msg.prompt_logprobs],
            base_top=[TokenLogprob.from_proto(t) for t in msg.base_top],
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NextTokenResult:
        return cls(
            token_id=data["token_id"], token=data["token"], logprob=data["logprob"],
            top=[TokenLogprob.from_dict(t) for t in data["top"]],
            prompt_token_ids=list(data["prompt_token_ids"]),
            timings=Timings.from_dict(data.get("timings") or {}),
            trace_id=data.get("trace_id", ""), batch_size=data.get("batch_size", 1),
            layers=[LayerReport.from_dict(layer) for layer in data.get("layers") or []],
            prompt_tokens=list(data.get("prompt_tokens") or []),
            walkthrough=[ShapeStep.from_dict(step) for step in data.get("walkthrough") or []],
            prompt_logprobs=[PromptTokenLogprob.from_dict(p) for p in data.get("prompt_logprobs") or []],
            base_top=[TokenLogprob.from_dict(t) for t in data.get("base_top") or []],
        )

    def to_dict(self) -> dict[str, Any]:
        """As dataclasses.asdict, which spent half a REST call's transport CPU copying it."""
        return {"token_id": self.token_id, "token": self.token, "logprob": self.logprob,
                "top": [t.to_dict() for t in self.top], "prompt_token_ids": list(self.prompt_token_ids),
                "timings": self.timings.to_dict(), "trace_id": self.trace_id, "batch_size": self.batch_size,
                "layers": [asdict(layer) for layer in self.layers], "prompt_tokens": list(self.prompt_tokens),
                "walkthrough": [asdict(step) for step in self.walkthrough],
                "prompt_logprobs": [asdict(p) for p in self.prompt_logprobs],
                "base_top": [t.to_dict() for t in self.base_top]}


@dataclass(frozen=True)
class Architecture:
    n_layer: int
    n_head: int
    d_model: int
    d_head: int
    d_mlp: int
    n_ctx: int
    vocab_size: int


@dataclass(frozen=True)
class ParameterBreakdown:
    token_embedding: int
    position_embedding: int
    attention_qkv: int
    attention_output: int
    mlp: int
    layer_norm: int
    lm_head: int
    total: int


@dataclass(frozen=True)
class ModelInfo:
    model: str
    weights: str  # "pretrained" | "random"
    weights_source: str
    dtype: str
    device: str
    architecture: Architecture
    parameters: ParameterBreakdown
    max_prompt_tokens: int
    max_batch_size: int
    max_running_sequences: int = 0  # generations decoded together at most (KV-cache slots)
    quantize: str = "none"  # weight storage when smaller than dtype: "int8" or "fp16" (--quantize)
    prefix_cache_tokens: int = 0  # prompt tokens the prefix cache can hold (--prefix-cache-mb); 0: off
    prefix_cache_bytes: int = 0  # its memory: claimed at start on cuda, the most it grows to on a CPU
    chat_completions: bool = False  # /v1/chat/completions has a chat template to form prompts with
    chat_template_source: str = ""  # where that template came from (--chat-template, or the checkpoint's own)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters served beside the base (--lora-modules)

    def to_proto(self) -> pb.ModelInfo:
        data = asdict(self)
        return pb.ModelInfo(
            **{**data, "architecture": pb.Architecture(**data["architecture"]),
               "parameters": pb.ParameterBreakdown(**data["parameters"])}
        )

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        scalars = {f: getattr(msg, f) for f in cls.__dataclass_fields__ if f not in ("architecture", "parameters")}
        scalars["adapters"] = list(scalars["adapters"])
        return cls(
            **scalars,
            architecture=Architecture(**{f: getattr(msg.architecture, f) for f in Architecture.__dataclass_fields__}),
            parameters=ParameterBreakdown(
                **{f: getattr(msg.parameters, f) for f in ParameterBreakdown.__dataclass_fields__}
            ),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        scalars = {f: data[f] for f in cls.__dataclass_fields__ if f not in ("architecture", "parameters") and f in data}
        return cls(
            **scalars,
            architecture=Architecture(**{f: data["architecture"][f] for f in Architecture.__dataclass_fields__}),
            parameters=ParameterBreakdown(
                **{f: data["parameters"][f] for f in ParameterBreakdown.__dataclass_fields__}
            ),
        )


@dataclass(frozen=True)
class HealthStatus:
    serving: bool
    status: str  # "SERVING", "NOT_SERVING", ...


@dataclass(frozen=True)
class TokenizeResult:
    """A text's (or a conversation's) token ids, their count, and the longest prompt the server takes."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # each token's text, when asked

    def to_proto(self) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(tokens=self.tokens, count=self.count, max_model_len=self.max_model_len,
                                   token_strs=self.token_strs or ())

    @classmethod
    def from_proto(cls, msg: pb.TokenizeResponse) -> TokenizeResult:
        return cls(list(msg.tokens), msg.count, msg.max_model_len, list(msg.token_strs) if msg.token_strs else None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizeResult:
        return cls(list(data["tokens"]), data["count"], data["max_model_len"], data.get("token_strs"))
