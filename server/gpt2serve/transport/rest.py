"""The REST transport (FastAPI): JSON bodies mirroring the proto, OpenAPI at /docs.

The POST routes (next-token, batch, generate, and OpenAI's completions and chat) are
InferenceRoutes, answered by the front end's HTTP protocol itself (transport.http_direct): each
body is read one way and every error is rendered and counted one way (http_errors.HttpErrors,
statuses from gpt2serve_client.status). FastAPI serves the rest and documents all of them, from
the same table.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2serve_client.status import ERROR_STATUSES
from gpt2serve_client.generation import GenerateResult
from gpt2serve_client.types import ModelInfo, NextTokenResult

from .. import __version__
from ..config import ServeConfig
from ..errors import InvalidArgument, MalformedBody, MethodNotAllowed, NotFound, ServeError, Unavailable
from ..service import GenerateSettings, InferenceService, PromptInput, RequestOptions
from ..service.generation_stream import token_chunk
from .guard import BearerKey, HttpGuard
from .http_direct import SSE_HEADERS, CallHead, DirectRoute, DirectRoutes, EventStream
from .http_errors import HttpErrors, describe_validation_errors, read_body
from .http_shared import ClientDisconnected, call_options, unless_disconnected
from .openai import CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE
from .openai import PATHS as OPENAI_PATHS
from .openai import ChatCompletionBody, CompletionBody, OpenAIErrorBody, OpenAIRoutes
from .openai.chat import ChatMessage, conversation_prompt
from .sampling_fields import SamplingControls, StructuredOutputFields
from .sse import dataclass_json, json_bytes, sse_event
from .lora_routes import LOAD_PATH as LOAD_LORA_PATH, PATHS as LORA_PATHS, UNLOAD_PATH as UNLOAD_LORA_PATH, add_lora_routes
from .tokenize_routes import DETOKENIZE_PATHS, TOKENIZE_PATHS, add_tokenize_routes
from .ui import add_ui_routes

log = logging.getLogger(__name__)
# The metrics method label of each path: the gRPC method it mirrors (a fixed set, whatever path a client sends).
METHODS = {"/v1/next-token": "NextToken", "/v1/next-token/batch": "NextTokenBatch", "/v1/generate": "Generate",
           COMPLETIONS_ROUTE: "Completions", CHAT_ROUTE: "ChatCompletions", "/v1/model": "GetModelInfo",
           MODELS_ROUTE: "ListModels", **dict.fromkeys(TOKENIZE_PATHS, "Tokenize"),
           **dict.fromkeys(DETOKENIZE_PATHS, "Detokenize"), LOAD_LORA_PATH: "LoadAdapter",
           UNLOAD_LORA_PATH: "UnloadAdapter"}


def method_of(path: str) -> str:
    return METHODS.get(path, "other")


class RestError(BaseModel):
    code: str = Field(description="gRPC status name, e.g. INVALID_ARGUMENT")
    message: str


class RestErrorBody(BaseModel):
    """Every REST error answer."""
    error: RestError


def error_responses(openai: bool, kinds: tuple[str, ...] | None = None) -> dict[int, dict]:
    """OpenAPI `responses` for the errors a route gives, from the status table."""
    by_status: dict[int, list[str]] = {}
    for status in ERROR_STATUSES:
        if (kinds is None and status.kind not in ("cancelled", "method_not_allowed")
                and (openai or status.kind != "not_found")) or (kinds is not None and status.kind in kinds):
            by_status.setdefault(status.openai_http if openai else status.http, []).append(
                f"{status.code}: {status.when}")
    model = OpenAIErrorBody if openai else RestErrorBody
    return {http: {"model": model, "description": "; ".join(lines)} for http, lines in sorted(by_status.items())}


class Body(BaseModel):
    # Unknown fields are errors, so a typo ("topk") is reported instead of silently ignored.
    model_config = ConfigDict(extra="forbid")


PROMPT_LOGPROBS_FIELD = Field(None, description="Also score the prompt: each token's log-probability given the "
                                                "ones before it, its rank, and this many alternatives (0..20)")
ADAPTER_FIELD = Field(None, description="A LoRA adapter served beside the base (GET /v1/models, --lora-modules), by "
                                        "name; unset: the base model. One not served: 404")


class NextTokenBody(Body):
    prompt: StrictStr | None = Field(None, description="Prompt text", examples=["The capital of France is"])
    prompt_token_ids: list[StrictInt] | None = Field(None, description="Prompt as GPT-2 token ids, instead of text")
    top_k: StrictInt | None = Field(None, description="How many alternatives to return (1..vocab); default 5")
    trace_layers: StrictBool = False
    include_layers: StrictBool = False
    attention_maps: StrictBool = Field(False, description="Also every head's attention pattern and the logit "
                                                          "lens at every position, per layer (at most 128 tokens)")
    prompt_logprobs: StrictInt | None = PROMPT_LOGPROBS_FIELD
    adapter: StrictStr | None = ADAPTER_FIELD
    compare_base: StrictBool = Field(False, description="With an adapter: the base model beside it in the same "
                                     "forward, per layer (base_* fields) and its top-k (base_top)")


class NextTokenBatchBody(Body):
    prompts: list[StrictStr | list[StrictInt]] = Field(
        ..., description="Prompt texts or token-id lists", examples=[["The capital of France is", [464, 3139]]]
    )
    top_k: StrictInt | None = None
    trace_layers: StrictBool = False
    include_layers: StrictBool = False
    prompt_logprobs: StrictInt | None = PROMPT_LOGPROBS_FIELD
    adapter: StrictStr | None = ADAPTER_FIELD


class GenerateBody(Body, SamplingControls, StructuredOutputFields):
    prompt: StrictStr | None = Field(None, description="Prompt text", examples=["The capital of France is"])
    prompt_token_ids: list[StrictInt] | None = Field(None, description="Prompt as GPT-2 token ids, instead of text")
    messages: list[ChatMessage] | None = Field(
        None, description="A conversation instead of a prompt, rendered by the chat template as "
                          "/v1/chat/completions renders it (so trace_steps can show a chat answer)")
    max_tokens: StrictInt | None = Field(None, description="Tokens to generate at most (default 16)")
    temperature: StrictFloat | StrictInt | None = Field(None, description="0: greedy; default 1")
    top_k: StrictInt | None = Field(None, description="Sample among the k most likely (0: no limit)")
    top_p: StrictFloat | StrictInt | None = Field(None, description="Nucleus sampling mass (default 1)")
    seed: StrictInt | None = Field(None, description="The same seed, the same tokens, whatever shares the batch")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="Stop before these strings (not returned)")
    stop_token_ids: list[StrictInt] = Field(default_factory=list, description="Stop at these tokens (not returned)")
    logprobs: StrictInt = Field(0, description="Top alternatives returned with each token (0..20)")
    ignore_eos: StrictBool = False
    trace_layers: StrictBool = False
    trace_steps: StrictBool = Field(False, description="Each token comes with how the model chose it (`step`: "
                                    "attention over the KV cache, logit lens, top tokens, shapes); prompt and "
                                    "max_tokens within 128 tokens")
    stream: StrictBool = Field(False, description="Server-sent events: one per token, then a closing one")
    adapter: StrictStr | None = ADAPTER_FIELD

    def settings(self) -> GenerateSettings:
        return GenerateSettings(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids, logprobs=self.logprobs, ignore_eos=self.ignore_eos, **self.controls(),
            constraint=self.constraint(), adapter=self.adapter)


class BatchResults(BaseModel):
    results: list[NextTokenResult]


def request_options(head: CallHead, route: str, method: str,
                    body: NextTokenBody | NextTokenBatchBody) -> RequestOptions:
    """The next-token routes' options: what the body asked to see."""
    return call_options(head, route, method, trace_layers=body.trace_layers, include_layers=body.include_layers,
                        attention_maps=getattr(body, "attention_maps", False),  # these two: /v1/next-token only
                        compare_base=getattr(body, "compare_base", False))


async def collect(chunks) -> list:
    return [chunk async for chunk in chunks]


def batch_prompt(item: str | list[int]) -> PromptInput:
    return PromptInput(text=item) if isinstance(item, str) else PromptInput(token_ids=item)


def create_app(service: InferenceService, config: ServeConfig | None = None) -> tuple[HttpGuard, DirectRoutes]:
    """The ASGI app, the guard (API key, body size) in front of the inference routes and FastAPI;
    and the routes the front end's HTTP protocol answers itself (transport.http_direct)."""
    config = config or ServeConfig()
    errors = HttpErrors(service.count_refusal, method_of, (*OPENAI_PATHS, *LORA_PATHS))  # vLLM's routes: its errors
    routes = InferenceRoutes(service, errors)
    guard = HttpGuard(routes.asgi(create_fastapi(service, routes, errors, config)),
                      key=BearerKey(config.api_key) if config.api_key else None,
                      max_body_bytes=config.max_message_bytes, metrics_open=not config.metrics_require_key,
                      errors=errors)
    direct = {path: DirectRoute(route.body_type, route.handler) for path, route in routes.routes.items()}
    return guard, DirectRoutes(direct, guard, errors, service.accepted)


def create_fastapi(service: InferenceService, routes: InferenceRoutes, errors: HttpErrors,
                   config: ServeConfig) -> FastAPI:
    # FastAPI's own telemetry is off: the service makes the request span (with the trace_layers
    # sampling rule) and a second server span per request would only add cost and clutter.
    app = FastAPI(title="gpt2serve", version=__version__, description="GPT-2 next-token server",
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
                  docs_url=None, redoc_url=None)  # served offline by add_ui_routes

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError) -> Response:
        return errors.response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return errors.response(request.url.path, MalformedBody(describe_validation_errors(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        error = (NotFound(f"no route {path}") if exc.status_code == 404 else
                 MethodNotAllowed(f"{request.method} is not allowed on {path}") if exc.status_code == 405 else
                 MalformedBody(str(exc.detail)))
        return errors.response(path, error)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        return errors.response(request.url.path, exc)

    for path, route in routes.routes.items():  # served by InferenceRoutes.asgi in front; documented here
        app.add_api_route(path, route.documented(), methods=["POST"], response_model=route.response_model,
                          responses={**error_responses(path in OPENAI_PATHS), **route.responses},
                          description=route.handler.__doc__, summary=route.summary)

    @app.get("/v1/model", response_model=ModelInfo,
             responses=error_responses(False, ("unauthenticated", "unavailable", "internal")))
    async def model_info() -> ModelInfo:
        """The model: architecture, dtype, device, weights and their source, parameters by component,
        the limits, and whether chat has a template (and where it came from)."""
        return service.model_info()

    @app.get(MODELS_ROUTE, responses=error_responses(True, ("unauthenticated", "unavailable", "internal")))
    async def list_models() -> dict:
        """OpenAI's model list: the one model this server serves."""
        return await routes.openai.list_models()

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics; OpenMetrics (with trace-id exemplars) when the Accept header asks."""
        body, content_type = service.telemetry.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/healthz")
    async def healthz() -> dict:
        """Alive: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", responses=error_responses(False, ("unavailable",)))
    async def readyz(request: Request) -> Response:
        """Ready: the model is loaded, the engine is up, and requests are accepted."""
        if service.ready:
            return JSONResponse({"status": "ready"})
        not_ready = Unavailable("not ready")
        not_ready.counted = True  # a probe's answer, not a refused request
        return errors.response(request.url.path, not_ready)

    add_tokenize_routes(app, service, error_responses(False, ("invalid_argument", "failed_precondition",
                                                              "not_found", "malformed", "unavailable")))
    add_lora_routes(app, service, error_responses(True, ("invalid_argument", "failed_precondition", "not_found",
                                                        "unavailable")))
    add_ui_routes(app, config)
    document_only_real_errors(app)
    return app


def document_only_real_errors(app: FastAPI) -> None:
    """FastAPI documents a 422 `HTTPValidationError` on every route with a body unless the route
    lists a 422 of its own; the OpenAI routes answer 400 for malformed bodies, so drop it there."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = build()
            for path in (*OPENAI_PATHS, *LORA_PATHS):
                for operation in spec["paths"].get(path, {}).values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


@dataclass(frozen=True)
class Route:
    body_type: type[BaseModel]
    # Takes (CallHead, body); returns the answer's JSON, or its events (http_direct.EventStream).
    handler: Callable[[CallHead, Any], Awaitable[bytes | EventStream]]
    response_model: Any = None
    summary: str = ""
    responses: dict = field(default_factory=dict)  # OpenAPI, beyond the errors

    def documented(self):
        """An endpoint FastAPI can read the body type from, for OpenAPI (InferenceRoutes.asgi
        answers these paths before FastAPI would)."""
        async def endpoint(request: Request, body) -> Response:
            return as_response(await self.handler(CallHead.of(request.scope), body))

        endpoint.__annotations__ = {"request": Request, "body": self.body_type, "return": Response}
        return endpoint


def as_response(answer: bytes | EventStream) -> Response:
    """A route's answer as a Starlette response, for an ASGI server (the routes return JSON
    encoded already: re-validating our own output through pydantic on the hot path cost more
    CPU than the rest of the REST handler; `response_model` still documents it)."""
    if type(answer) is EventStream:
        return StreamingResponse(answer.events, headers={n.decode(): v.decode() for n, v in SSE_HEADERS})
    return Response(answer, media_type="application/json")


SSE = {200: {"content": {"text/event-stream": {}}}}


class InferenceRoutes:
    """The POST routes, served in front of FastAPI.

    FastAPI's routing, dependency solving and middleware stack cost more CPU per request than
    the rest of the request path, which on a 2-core machine slowed the forward passes of a
    64-client REST load. The front end's protocol answers these routes itself
    (transport.http_direct); FastAPI documents them from this same table (create_fastapi).
    """

    def __init__(self, service: InferenceService, errors: HttpErrors):
        self.service = service
        self.errors = errors
        self.openai = OpenAIRoutes(service, lambda error: errors.body(COMPLETIONS_ROUTE, error))
        self.routes = {
            "/v1/next-token": Route(NextTokenBody, self.next_token, NextTokenResult, "Next token of one prompt"),
            "/v1/next-token/batch": Route(NextTokenBatchBody, self.next_token_batch, BatchResults,
                                          "Next token of many prompts, in order"),
            "/v1/generate": Route(GenerateBody, self.generate, GenerateResult, "Generate text", SSE),
            COMPLETIONS_ROUTE: Route(CompletionBody, self.openai.completions.completions, None, "OpenAI completions",
                                     SSE),
            CHAT_ROUTE: Route(ChatCompletionBody, self.openai.chat.completions, None, "OpenAI chat completions", SSE),
        }

    async def next_token(self, head: CallHead, body: NextTokenBody) -> bytes:
        """The next token of one prompt, with its top-k (and per-layer reports when asked)."""
        prompt = PromptInput(text=body.prompt, token_ids=body.prompt_token_ids)
        options = request_options(head, "/v1/next-token", "NextToken", body)
        result = await self.service.next_token(prompt, body.top_k, options, body.prompt_logprobs, body.adapter)
        return dataclass_json(result, result.to_dict)

    async def next_token_batch(self, head: CallHead, body: NextTokenBatchBody) -> bytes:
        """The next token of each prompt, in order (`{"results": [...]}`)."""
        prompts = [batch_prompt(p) for p in body.prompts]
        options = request_options(head, "/v1/next-token/batch", "NextTokenBatch", body)
        results = await self.service.next_token_batch(prompts, body.top_k, options, body.prompt_logprobs, body.adapter)
        return dataclass_json({"results": results}, lambda: {"results": [r.to_dict() for r in results]})

    async def generate(self, head: CallHead, body: GenerateBody) -> bytes | EventStream:
        """Generate text. With `"stream": true`, server-sent events: one `data:` JSON chunk per
        token (text, token), or per run of tokens the reader had not taken yet (their text, the
        first token, the rest in more_tokens), then a closing chunk (finish_reason, usage,
        timings); an error after the stream began comes as an `event: error` with the usual
        error body."""
        prompt, chat = await self.generate_prompt(body)
        options = call_options(head, "/v1/generate", "Generate", attributes=chat, trace_layers=body.trace_layers,
                               trace_steps=body.trace_steps)
        stream = self.service.generation_stream(prompt, body.settings(), options)
        chunks = stream.chunks(coalesce=body.stream)
        if not body.stream:
            return json_bytes(asdict(GenerateResult.from_chunks(await collect(chunks))))
        first = await anext(chunks)  # the request's errors raise here, before the 200

        async def events():
            try:
                yield sse_event(first.to_dict())
                async for chunk in chunks:
                    yield sse_event(chunk.to_dict())
            except ServeError as exc:
                yield sse_event(self.errors.body("/v1/generate", exc), event="error")
            finally:
                await chunks.aclose()

        token_text = self.service.validator.tokenizer.token_text
        return EventStream(events(), (stream.follow, lambda text, tokens: sse_event(
            token_chunk(token_text, text, tokens).to_dict())))

    async def generate_prompt(self, body: GenerateBody) -> tuple[PromptInput, dict]:
        """The prompt as given, or the conversation's through the chat template (and what the
        span says of it)."""
        if body.messages is None:
            return PromptInput(text=body.prompt, token_ids=body.prompt_token_ids), {}
        if body.prompt or body.prompt_token_ids:
            raise InvalidArgument("messages: give prompt, prompt_token_ids or messages, one of them")
        token_ids, seen = await conversation_prompt(self.service, body.messages)
        return PromptInput(token_ids=token_ids), seen

    def asgi(self, fallback: FastAPI):
        """These routes under an ASGI server: only for a POST the front end's protocol hands to
        ASGI (one asking for a protocol upgrade), answered as the protocol would."""
        async def app(scope, receive, send) -> None:
            path = scope.get("path")
            route = self.routes.get(path) if scope["type"] == "http" else None
            if route is None or scope.get("method") != "POST":
                return await fallback(scope, receive, send)
            request = Request(scope, receive)
            with self.service.accepted(f"POST {path}"):  # until the last byte (or event) is sent
                try:
                    body = await read_body(request, route.body_type)
                    response = as_response(await unless_disconnected(request, route.handler(CallHead.of(scope), body)))
                except ClientDisconnected:
                    return  # Nobody to answer.
                except Exception as exc:
                    response = self.errors.response(path, exc)
                await response(scope, receive, send)

        return app
