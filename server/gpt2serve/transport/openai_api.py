"""OpenAI-compatible completions: `POST /v1/completions` and `GET /v1/models`, so the official
`openai` client (and tools built on it) can talk to gpt2serve.

Translation only, like the other transports: OpenAI's fields become a service generate call,
and its chunks become OpenAI's JSON. GPT-2 has no chat template, so there is no chat endpoint.
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from gpt2serve_client.types import GeneratedToken, GenerateResult

from ..errors import InvalidArgument, ServeError
from ..generating import GenerateSettings
from ..service import InferenceService, PromptInput, RequestOptions
from .sse import first_and_rest, sse_event

ROUTE = "/v1/completions"
PATHS = (ROUTE, "/v1/models")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class CompletionBody(BaseModel):
    # Unknown fields are ignored, as OpenAI's own server does with fields it does not know.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = 0
    frequency_penalty: StrictFloat | StrictInt | None = 0
    logit_bias: dict[str, Any] | None = None
    suffix: StrictStr | None = None
    user: StrictStr | None = None
    # Not OpenAI's, but common in OpenAI-compatible servers (vLLM): passed as extra_body.
    top_k: StrictInt | None = Field(None, description="gpt2serve extension: sample among the k most likely")
    ignore_eos: StrictBool = Field(False, description="gpt2serve extension: generate past the end-of-text token")

    def prompt_input(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument(f"prompt: {len(prompt)} prompts in one request; gpt2serve takes one "
                                      "(send them as separate requests: they are batched together)")
            prompt = prompt[0]
        return PromptInput(text=prompt) if isinstance(prompt, str) else PromptInput(token_ids=prompt)

    def settings(self) -> GenerateSettings:
        unsupported = [name for name, ok in (
            ("n", self.n in (None, 1)), ("best_of", self.best_of in (None, 1)), ("echo", not self.echo),
            ("suffix", self.suffix is None), ("logit_bias", not self.logit_bias),
            ("presence_penalty", not self.presence_penalty), ("frequency_penalty", not self.frequency_penalty),
        ) if not ok]
        if unsupported:
            raise InvalidArgument(f"{unsupported[0]}: not supported by gpt2serve (only its default)")
        return GenerateSettings(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            logprobs=self.logprobs or 0, ignore_eos=self.ignore_eos)


def is_openai_path(path: str) -> bool:
    return path in PATHS


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def logprobs_json(tokens: list[GeneratedToken], texts: list[str], offset: int) -> dict:
    """OpenAI's legacy completions logprobs: per token its text, logprob, top alternatives, offset."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens], "text_offset": offsets}


def add_openai_routes(app: FastAPI, service: InferenceService) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict:
        """OpenAI's model list: the one model this server serves."""
        info = service.model_info()
        return {"object": "list", "data": [{"id": info.model, "object": "model", "created": 0,
                                            "owned_by": "gpt2serve"}]}

    @app.post(ROUTE)
    async def completions(body: CompletionBody, request: Request) -> Response:
        """OpenAI's completions API (see the module doc for what is supported)."""
        try:
            model = service.model_info().model
            if body.model != model:
                return openai_error(404, f"The model '{body.model}' does not exist; this server serves '{model}'",
                                    "model", "model_not_found")
            options = RequestOptions(
                api="openai", method="Completions", span_name=f"POST {ROUTE}",
                parent=propagate.extract(request.headers),
                attributes={"http.request.method": "POST", "http.route": ROUTE, "url.scheme": request.url.scheme})
            chunks = service.generate(body.prompt_input(), body.settings(), options)
            completion = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                          "model": model}
            if body.stream:
                stream = await first_and_rest(chunks)  # request errors raise here, before the 200
                include_usage = bool((body.stream_options or {}).get("include_usage"))
                return StreamingResponse(stream_events(completion, stream, include_usage, body.logprobs),
                                         media_type="text/event-stream", headers={"cache-control": "no-cache"})
            result = GenerateResult.from_chunks([chunk async for chunk in chunks])
        except ServeError as exc:
            return openai_error(exc.http_status, exc.message)
        choice = {"index": 0, "text": result.text, "finish_reason": finish_reason(result.finish_reason),
                  "logprobs": logprobs_json(result.tokens, [t.token for t in result.tokens], 0)
                  if body.logprobs is not None else None}
        return JSONResponse({**completion, "choices": [choice], "usage": usage_json(result)})


async def stream_events(completion: dict, chunks, include_usage: bool, logprobs: int | None):
    """OpenAI's stream: a chunk per token (text delta), the last with its finish_reason, the
    usage in a chunk of its own when asked for, then `data: [DONE]`."""
    offset = 0
    try:
        async for chunk in chunks:
            tokens = [chunk.token] if chunk.token else []
            choice = {"index": 0, "text": chunk.text, "finish_reason": finish_reason(chunk.finish_reason) or None,
                      "logprobs": logprobs_json(tokens, [chunk.text], offset) if logprobs is not None else None}
            offset += len(chunk.text)
            yield sse_event({**completion, "choices": [choice]})
            if chunk.finish_reason and include_usage:
                yield sse_event({**completion, "choices": [], "usage": usage_json(GenerateResult.from_chunks([chunk]))})
    except ServeError as exc:
        yield sse_event({"error": {"message": exc.message, "type": ERROR_TYPES.get(exc.http_status, "server_error"),
                               "param": None, "code": None}})
    yield sse_event("[DONE]")


def finish_reason(reason: str) -> str:
    """OpenAI has "stop" and "length"; the end-of-text token is a stop there."""
    return "stop" if reason == "eos" else reason


def usage_json(result: GenerateResult) -> dict:
    u = result.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}
