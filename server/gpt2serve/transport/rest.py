"""The REST transport (FastAPI): JSON bodies mirroring the proto, OpenAPI at /docs.

Errors answer `{"error": {"code": "INVALID_ARGUMENT", "message": "..."}}` with the matching
HTTP status: 400 for bad values, 422 for malformed JSON or wrong types, 429 when the queue is
full, 503 while not ready.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from gpt2serve_client.types import GenerateResult, ModelInfo, NextTokenResult

from .. import __version__
from ..config import ServeConfig
from ..errors import INTERNAL_MESSAGE, PayloadTooLarge, ServeError
from ..generating import GenerateSettings
from ..service import InferenceService, PromptInput, RequestOptions
from .guard import BearerKey, HttpGuard
from .http_shared import ClientDisconnected, http_options, retry_after, unless_disconnected
from .openai_api import add_openai_routes, is_openai_path, openai_error
from .sse import first_and_rest, sse_event
from .ui import add_ui_routes

log = logging.getLogger(__name__)


class Body(BaseModel):
    # Unknown fields are errors, so a typo ("topk") is reported instead of silently ignored.
    model_config = ConfigDict(extra="forbid")


class NextTokenBody(Body):
    prompt: StrictStr | None = Field(None, description="Prompt text", examples=["The capital of France is"])
    prompt_token_ids: list[StrictInt] | None = Field(None, description="Prompt as GPT-2 token ids, instead of text")
    top_k: StrictInt | None = Field(None, description="How many alternatives to return (1..vocab); default 5")
    trace_layers: StrictBool = False
    include_layers: StrictBool = False
    attention_maps: StrictBool = Field(False, description="Also every head's attention pattern and the logit "
                                                          "lens at every position, per layer (at most 128 tokens)")


class NextTokenBatchBody(Body):
    prompts: list[StrictStr | list[StrictInt]] = Field(
        ..., description="Prompt texts or token-id lists", examples=[["The capital of France is", [464, 3139]]]
    )
    top_k: StrictInt | None = None
    trace_layers: StrictBool = False
    include_layers: StrictBool = False


class GenerateBody(Body):
    prompt: StrictStr | None = Field(None, description="Prompt text", examples=["The capital of France is"])
    prompt_token_ids: list[StrictInt] | None = Field(None, description="Prompt as GPT-2 token ids, instead of text")
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
    stream: StrictBool = Field(False, description="Server-sent events: one per token, then a closing one")

    def settings(self) -> GenerateSettings:
        return GenerateSettings(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids, logprobs=self.logprobs, ignore_eos=self.ignore_eos)


class BatchResults(BaseModel):
    results: list[NextTokenResult]


def json_response(payload: dict) -> Response:
    """Encode results directly: re-validating our own output through pydantic on the hot path
    cost more CPU than the rest of the REST handler. `response_model` still documents it."""
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


OTHER_METHODS = {"/v1/model": "GetModelInfo", "/v1/generate": "Generate", "/v1/completions": "Completions"}
def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}},
                        headers=retry_after(status))


def describe_validation_error(request: Request, errors: list[dict]) -> str:
    if "json" not in request.headers.get("content-type", ""):
        return "the body must be a JSON object sent with 'Content-Type: application/json'"
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def request_options(request: Request, route: str, method: str,
                    body: NextTokenBody | NextTokenBatchBody) -> RequestOptions:
    """The next-token routes' options: what the body asked to see."""
    return http_options(request, route, method, trace_layers=body.trace_layers, include_layers=body.include_layers,
                        attention_maps=getattr(body, "attention_maps", False))  # /v1/next-token only


async def collect(chunks) -> list:
    return [chunk async for chunk in chunks]


def batch_prompt(item: str | list[int]) -> PromptInput:
    return PromptInput(text=item) if isinstance(item, str) else PromptInput(token_ids=item)


def create_app(service: InferenceService, config: ServeConfig | None = None):
    """The ASGI app: the guard (API key, body size) in front of the inference routes and FastAPI."""
    config = config or ServeConfig()
    routes = InferenceRoutes(service)
    return HttpGuard(
        routes.asgi(create_fastapi(service, routes, config)),
        key=BearerKey(config.api_key) if config.api_key else None, max_body_bytes=config.max_message_bytes,
        metrics_open=not config.metrics_require_key, method_of=routes.method_of,
        refused=lambda method, code: service.count_refusal("rest", method, code),
    )


def create_fastapi(service: InferenceService, routes: InferenceRoutes, config: ServeConfig) -> FastAPI:
    # FastAPI's own telemetry is off: the service makes the request span (with the trace_layers
    # sampling rule) and a second server span per request would only add cost and clutter.
    app = FastAPI(title="gpt2serve", version=__version__, description="GPT-2 next-token server",
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
                  docs_url=None, redoc_url=None)  # served offline by add_ui_routes

    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc.http_status, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = describe_validation_error(request, exc.errors())
        if is_openai_path(request.url.path):
            return openai_error(400, message)
        return error_response(422, "INVALID_ARGUMENT", message)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "INTERNAL", INTERNAL_MESSAGE)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return error_response(499, "CANCELLED", "client closed the connection")  # Never read by anyone.

    # These two are served by InferenceRoutes.asgi in front of FastAPI; declared here for OpenAPI.
    @app.post("/v1/next-token", response_model=NextTokenResult)
    async def next_token(body: NextTokenBody, request: Request) -> Response:
        return await routes.next_token(request, body)

    @app.post("/v1/next-token/batch", response_model=BatchResults)
    async def next_token_batch(body: NextTokenBatchBody, request: Request) -> Response:
        return await routes.next_token_batch(request, body)

    @app.post("/v1/generate", response_model=GenerateResult, responses={200: {"content": {"text/event-stream": {}}}})
    async def generate(body: GenerateBody, request: Request) -> Response:
        """Generate text. With `"stream": true`, server-sent events: one `data:` JSON chunk per
        token (text, token), then a closing chunk (finish_reason, usage, timings); an error
        after the stream began comes as an `event: error` with the usual error body."""
        options = http_options(request, "/v1/generate", "Generate", trace_layers=body.trace_layers)
        chunks = service.generate(PromptInput(text=body.prompt, token_ids=body.prompt_token_ids), body.settings(),
                                  options)
        if not body.stream:
            collected = await unless_disconnected(request, collect(chunks))
            return json_response(asdict(GenerateResult.from_chunks(collected)))
        stream = await unless_disconnected(request, first_and_rest(chunks))

        async def events():
            try:
                async for chunk in stream:
                    yield sse_event(asdict(chunk))
            except ServeError as exc:
                yield sse_event({"error": {"code": exc.code, "message": exc.message}}, event="error")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @app.get("/v1/model", response_model=ModelInfo)
    async def model_info() -> ModelInfo:
        return service.model_info()

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics; OpenMetrics (with trace-id exemplars) when the Accept header asks."""
        body, content_type = service.telemetry.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/healthz")
    async def healthz() -> dict:
        """Alive: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready: the model is loaded and requests are accepted."""
        if service.ready:
            return JSONResponse({"status": "ready"})
        return error_response(503, "UNAVAILABLE", "not ready")

    add_openai_routes(app, service)
    add_ui_routes(app, config)
    return app


class InferenceRoutes:
    """The two inference routes, served in front of FastAPI.

    FastAPI's routing, dependency solving and middleware stack cost more CPU per request than
    the rest of the request path, which on a 2-core machine slowed the forward passes of a
    64-client REST load. These routes parse and validate the body with pydantic directly; every
    other path (docs, probes, model info) goes to FastAPI, which also documents these two.
    """

    def __init__(self, service: InferenceService):
        self.service = service
        # path -> (body type, handler, method name for metrics: the gRPC method it mirrors)
        self.routes = {"/v1/next-token": (NextTokenBody, self.next_token, "NextToken"),
                       "/v1/next-token/batch": (NextTokenBatchBody, self.next_token_batch, "NextTokenBatch")}

    def method_of(self, path: str) -> str:
        """The metrics method label of a path (a fixed set, whatever path a client sends)."""
        route = self.routes.get(path)
        return route[2] if route else OTHER_METHODS.get(path, "other")

    async def next_token(self, request: Request, body: NextTokenBody) -> Response:
        prompt = PromptInput(text=body.prompt, token_ids=body.prompt_token_ids)
        options = request_options(request, "/v1/next-token", "NextToken", body)
        result = await unless_disconnected(request, self.service.next_token(prompt, body.top_k, options))
        return json_response(asdict(result))

    async def next_token_batch(self, request: Request, body: NextTokenBatchBody) -> Response:
        prompts = [batch_prompt(p) for p in body.prompts]
        options = request_options(request, "/v1/next-token/batch", "NextTokenBatch", body)
        results = await unless_disconnected(request, self.service.next_token_batch(prompts, body.top_k, options))
        return json_response({"results": [asdict(r) for r in results]})

    def asgi(self, fallback: FastAPI):
        async def app(scope, receive, send) -> None:
            route = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
            if route is None or scope.get("method") != "POST":
                return await fallback(scope, receive, send)
            request = Request(scope, receive)
            try:
                response = await self.handle(request, *route)
            except ClientDisconnected:
                return  # Nobody to answer.
            except ServeError as exc:
                response = error_response(exc.http_status, exc.code, exc.message)
            except Exception:
                log.exception("unhandled error in %s", scope.get("path"))
                response = error_response(500, "INTERNAL", INTERNAL_MESSAGE)
            await response(scope, receive, send)

        return app

    async def handle(self, request: Request, body_type: type[Body], handler, method: str) -> Response:
        try:
            raw = await request.body()
        except PayloadTooLarge as exc:  # A chunked body that grew past the limit (see guard).
            self.service.count_refusal("rest", method, exc.code)
            raise
        errors: list[dict] = []
        if "json" in request.headers.get("content-type", ""):
            try:
                body = body_type.model_validate_json(raw)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
            else:
                return await handler(request, body)
        # Malformed bodies never reach the service; count them here like its own refusals.
        self.service.count_refusal("rest", method, "INVALID_ARGUMENT")
        return error_response(422, "INVALID_ARGUMENT", describe_validation_error(request, errors))
