"""Build request messages and bodies from client arguments, once for all three clients."""

from __future__ import annotations

import difflib
import inspect
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from ._proto import gpt2serve_pb2 as pb

Prompt = str | Sequence[int]
# Statuses worth another try: the server is starting, draining or overloaded.
RETRYABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
DEFAULT_RETRIES = 3
DEFAULT_TIMEOUT_S = 30.0


def read_pem(pem: bytes | str | Path | None) -> bytes | None:
    """PEM bytes as given, or read from a file path."""
    if pem is None or isinstance(pem, bytes):
        return pem
    return Path(pem).read_bytes()

try:
    from opentelemetry import propagate as _propagate
except ImportError:  # The API is a dependency, but a stripped install still works untraced.
    _propagate = None


def request_headers(api_key: str | None) -> dict[str, str]:
    """Headers (gRPC metadata) for one call: the API key, if any, and the trace context."""
    headers = trace_headers()
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def trace_headers() -> dict[str, str]:
    """The caller's current trace context as W3C `traceparent` (and `tracestate`) headers, or {}.

    Sent as gRPC metadata and HTTP headers so the server's spans join the caller's trace."""
    carrier: dict[str, str] = {}
    if _propagate is not None:
        _propagate.inject(carrier)
    return carrier


def prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """A prompt is text or a sequence of token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": [int(t) for t in prompt]}


def next_token_proto(prompt: Prompt, top_k: int | None, trace_layers: bool, include_layers: bool,
                     attention_maps: bool = False, prompt_logprobs: int | None = None,
                     adapter: str | None = None, compare_base: bool = False) -> pb.NextTokenRequest:
    return pb.NextTokenRequest(
        **prompt_fields(prompt), top_k=top_k, trace_layers=trace_layers, include_layers=include_layers,
        attention_maps=attention_maps, prompt_logprobs=prompt_logprobs, adapter=adapter, compare_base=compare_base,
    )


def next_token_batch_proto(
    prompts: Sequence[Prompt], top_k: int | None, trace_layers: bool, include_layers: bool,
    prompt_logprobs: int | None = None, adapter: str | None = None,
) -> pb.NextTokenBatchRequest:
    return pb.NextTokenBatchRequest(
        prompts=[pb.Prompt(**prompt_fields(p)) for p in prompts],
        top_k=top_k, trace_layers=trace_layers, include_layers=include_layers, prompt_logprobs=prompt_logprobs,
        adapter=adapter,
    )


def next_token_json(prompt: Prompt, top_k: int | None, trace_layers: bool, include_layers: bool,
                    attention_maps: bool = False, prompt_logprobs: int | None = None,
                    adapter: str | None = None, compare_base: bool = False) -> dict[str, Any]:
    body = {**prompt_fields(prompt), "top_k": top_k, "trace_layers": trace_layers, "include_layers": include_layers,
            "attention_maps": attention_maps}
    if compare_base:  # sent only when set: a server before it refuses unknown fields
        body["compare_base"] = True
    return optional_fields(body, prompt_logprobs=prompt_logprobs, adapter=adapter)


def next_token_batch_json(
    prompts: Sequence[Prompt], top_k: int | None, trace_layers: bool, include_layers: bool,
    prompt_logprobs: int | None = None, adapter: str | None = None,
) -> dict[str, Any]:
    items = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    body = {"prompts": items, "top_k": top_k, "trace_layers": trace_layers, "include_layers": include_layers}
    return optional_fields(body, prompt_logprobs=prompt_logprobs, adapter=adapter)


def optional_fields(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The body with each field that is set (unset ones left out, as the server's defaults)."""
    return {**body, **{name: value for name, value in fields.items() if value is not None}}


def generate_fields(prompt: Prompt, max_tokens: int | None, temperature: float | None, top_k: int | None,
                    top_p: float | None, seed: int | None, stop: str | Sequence[str] | None,
                    stop_token_ids: Sequence[int] | None, logprobs: int, ignore_eos: bool,
                    trace_layers: bool, trace_steps: bool = False, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                    logit_bias: Mapping[int, float] | None = None, min_p: float | None = None,
                    min_tokens: int | None = None, json_schema: Mapping[str, Any] | str | None = None,
                    regex: str | None = None, choice: Sequence[str] | None = None,
                    grammar: str | None = None, adapter: str | None = None) -> dict[str, Any]:
    """A generate call's fields, the same for the proto and the JSON body (unset ones left out;
    logit_bias keyed by int: the JSON body's keys become strings, as OpenAI's are)."""
    fields = {**prompt_fields(prompt), "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
              "top_p": top_p, "seed": seed, "logprobs": logprobs, "ignore_eos": ignore_eos,
              "trace_layers": trace_layers, "trace_steps": trace_steps or None,
              "stop": [stop] if isinstance(stop, str) else list(stop or ()),
              "stop_token_ids": [int(t) for t in stop_token_ids or ()],
              "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
              "repetition_penalty": repetition_penalty, "min_p": min_p, "min_tokens": min_tokens,
              "logit_bias": {int(t): float(b) for t, b in logit_bias.items()} if logit_bias else None,
              "json_schema": json_schema if json_schema is None or isinstance(json_schema, str) else
              json.dumps(json_schema), "regex": regex, "choice": list(choice) if choice else None,
              "grammar": grammar, "adapter": adapter}
    return {name: value for name, value in fields.items() if value is not None}


STRUCTURED = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}  # proto -> JSON


def generate_json(**options: Any) -> dict[str, Any]:
    """generate_fields as /v1/generate's body: logit_bias keyed by strings, structured output
    under vLLM's structured_outputs."""
    fields = generate_fields(**options)
    if "logit_bias" in fields:
        fields["logit_bias"] = {str(t): b for t, b in fields["logit_bias"].items()}
    structured = {STRUCTURED[name]: fields.pop(name) for name in list(fields) if name in STRUCTURED}
    if "json" in structured:
        structured["json"] = json.loads(structured["json"])
    if structured:
        fields["structured_outputs"] = structured
    return fields


def generate_proto(**options: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(**generate_fields(**options))


Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]


def tokenize_proto(prompt: str | None, messages: Messages | None, add_generation_prompt: bool,
                   return_token_strs: bool) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(prompt=prompt or "", messages=[pb.ChatTurn(role=m["role"], content=m["content"])
                                                             for m in messages or ()],
                              add_generation_prompt=add_generation_prompt, return_token_strs=return_token_strs)


def tokenize_json(prompt: str | None, messages: Messages | None, add_generation_prompt: bool,
                  return_token_strs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "return_token_strs": return_token_strs}
    if messages is not None:
        body["messages"] = [dict(m) for m in messages]
    else:
        body["prompt"] = prompt or ""
    return body


def check_options(method: str, options: Mapping[str, Any], takes) -> None:
    """A `generate(**options)` passes its options on to `generate_stream`; a misspelled one is
    reported under the name the caller called (`method`), with the closest option it meant."""
    allowed = [name for name in inspect.signature(takes).parameters if name not in ("self", "prompt")]
    for name in options:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
