"""The gRPC transport: servicer, health, reflection. Translation only; rules live in the service package."""

from __future__ import annotations

import json
import functools
import logging
import time
from typing import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc

from ..config import ServeConfig
from ..errors import (INTERNAL_MESSAGE, InvalidArgument, ModelLoading, ServeError, ShuttingDown, StartupError,
                      Unauthenticated)
from ..service import GenerateSettings, InferenceService, PromptInput, RequestOptions
from ..service.validation import one_constraint
from ..telemetry.tracing import propagated_fields
from .grpc_builtin import HEALTH_SERVICE, BuiltinGrpcServer, health_methods, reflection_methods
from .grpc_calls import SERVER_STREAM, UNARY, GrpcApp, GrpcMethod, serialize
from .grpc_reflection import enable_reflection, service_names
from .openai.chat import ChatMessage
from .guard import AUTH_HINT, OPEN_GRPC_SERVICES, BearerKey, GrpcAuthInterceptor
from .h2_stream import CONNECTION_WINDOW, MAX_WINDOW, ConnectionPolicy
from .http_errors import RETRY_AFTER_S

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gpt2Serve"].full_name
# grpc-retry-pushback-ms, which gRPC retry policies honour: busy, retry in 250 ms; draining,
# do not retry here (a negative value), or the retry meets the closing server and ends CANCELLED.
RETRY_PUSHBACK_MS = "250"
NO_RETRY_PUSHBACK_MS = "-1"


def retry_pushback_ms(exc: ServeError) -> str | None:
    # Loading: not a retry policy's few quick tries either; retry-after says when (our clients wait).
    if isinstance(exc, (ShuttingDown, ModelLoading)):
        return NO_RETRY_PUSHBACK_MS
    return RETRY_PUSHBACK_MS if exc.code == "RESOURCE_EXHAUSTED" else None


class UndecodableRequest:
    """Stands in for a request protobuf could not parse (e.g. invalid UTF-8 in a string field).

    grpc's own deserializer error is an INTERNAL status the service never sees; this way the
    caller gets INVALID_ARGUMENT and the metrics count it."""

    def __init__(self, message_type: str, error: Exception):
        self.message = f"the request is not a valid {message_type} message: {error}"


def lenient(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, exc)

    return deserialize


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str,
                     refused: Callable[..., None]) -> None:
    """Turn ServeError into its gRPC status; anything else is INTERNAL, logged, never a crash.
    The one place gRPC refusals are counted, when the service has not counted them already."""
    if not isinstance(exc, ServeError):
        log.error("unhandled error in %s", method, exc_info=exc)
    code = exc.code if isinstance(exc, ServeError) else "INTERNAL"
    if not getattr(exc, "counted", False):
        refused("grpc", method, code, exc.message if isinstance(exc, ServeError) else INTERNAL_MESSAGE,
                f"{SERVICE_NAME}/{method}")
    if isinstance(exc, ServeError):
        pushback = retry_pushback_ms(exc)
        if pushback is not None:
            # A loading server also says when to come back, as REST's Retry-After does.
            loading = (("retry-after", RETRY_AFTER_S),) if isinstance(exc, ModelLoading) else ()
            context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback), *loading))
        await context.abort(grpc.StatusCode[exc.code], exc.message)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def status_errors(method):
    """Errors as gRPC statuses (see abort_with), for unary methods."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        with self.service.accepted(f"grpc {method.__name__}"):
            try:
                self.refuse_undecodable(request, method.__name__)
                return await method(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, method.__name__, self.service.count_refusal)

    return wrapper


def prompt_input(msg: pb.NextTokenRequest | pb.Prompt) -> PromptInput:
    return PromptInput(text=msg.prompt, token_ids=list(msg.prompt_token_ids))


def request_options(method: str, request, context: grpc.aio.ServicerContext) -> RequestOptions:
    """Span name and attributes, the caller's W3C trace context (metadata), and what it asked to see."""
    fields = propagated_fields()
    carrier = {key: value for key, value in (context.invocation_metadata() or ())
               if key in fields and isinstance(value, str)}
    remaining = context.time_remaining()
    return RequestOptions(
        api="grpc", method=method, span_name=f"{SERVICE_NAME}/{method}", trace_carrier=carrier or None,
        attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method},
        trace_layers=request.trace_layers, include_layers=getattr(request, "include_layers", False),
        attention_maps=getattr(request, "attention_maps", False),  # NextToken only
        compare_base=getattr(request, "compare_base", False),  # NextToken only
        trace_steps=getattr(request, "trace_steps", False),  # Generate only
        deadline=None if remaining is None else time.monotonic() + remaining,
    )


def generate_settings(msg: pb.GenerateRequest) -> GenerateSettings:
    def optional(name: str):
        return getattr(msg, name) if msg.HasField(name) else None

    return GenerateSettings(
        max_tokens=optional("max_tokens"), temperature=optional("temperature"), top_k=optional("top_k"),
        top_p=optional("top_p"), seed=optional("seed"), stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        logprobs=msg.logprobs, ignore_eos=msg.ignore_eos, min_tokens=optional("min_tokens"),
        logit_bias=dict(msg.logit_bias) or None, repetition_penalty=optional("repetition_penalty"),
        frequency_penalty=optional("frequency_penalty"), presence_penalty=optional("presence_penalty"),
        min_p=optional("min_p"), constraint=constraint_of(msg), adapter=optional("adapter"),
    )


def constraint_of(msg: pb.GenerateRequest) -> tuple[str, str, str] | None:
    """The structured output a Generate asked for (GenerateSettings.constraint), at most one."""
    return one_constraint([(kind, spec, kind) for kind, spec in (
        ("json_schema", msg.json_schema), ("regex", msg.regex),
        ("choice", json.dumps(list(msg.choice)) if msg.choice else ""), ("grammar", msg.grammar)) if spec])


class Gpt2ServeServicer(pb_grpc.Gpt2ServeServicer):
    def __init__(self, service: InferenceService):
        self.service = service

    def refuse_undecodable(self, request, method: str) -> None:
        if isinstance(request, UndecodableRequest):
            raise InvalidArgument(request.message)

    async def Generate(self, request: pb.GenerateRequest, context):
        """One message per token as the generation goes, or, to a caller that reads slower than
        tokens come, the tokens it has not read in one message (more_tokens); a caller that
        hangs up cancels it."""
        with self.service.accepted("grpc Generate"):
            try:
                self.refuse_undecodable(request, "Generate")
                options = request_options("Generate", request, context)
                async for chunk in self.service.generate(prompt_input(request), generate_settings(request), options,
                                                         coalesce=True):
                    yield chunk.to_proto()
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, "Generate", self.service.count_refusal)

    @status_errors
    async def NextToken(self, request: pb.NextTokenRequest, context) -> pb.NextTokenResponse:
        top_k = request.top_k if request.HasField("top_k") else None
        options = request_options("NextToken", request, context)
        scored = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        adapter = request.adapter if request.HasField("adapter") else None
        result = await self.service.next_token(prompt_input(request), top_k, options, scored, adapter)
        return result.to_proto()

    @status_errors
    async def NextTokenBatch(self, request: pb.NextTokenBatchRequest, context) -> pb.NextTokenBatchResponse:
        top_k = request.top_k if request.HasField("top_k") else None
        options = request_options("NextTokenBatch", request, context)
        scored = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        adapter = request.adapter if request.HasField("adapter") else None
        results = await self.service.next_token_batch([prompt_input(p) for p in request.prompts], top_k, options,
                                                      scored, adapter)
        return pb.NextTokenBatchResponse(results=[r.to_proto() for r in results])

    @status_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.service.model_info().to_proto()

    @status_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        messages = [ChatMessage(role=m.role, content=m.content).plain(i) for i, m in enumerate(request.messages)]
        add_generation_prompt = not request.HasField("add_generation_prompt") or request.add_generation_prompt
        return (await self.service.tokenize(request.prompt, messages or None, add_generation_prompt,
                                            request.return_token_strs)).to_proto()

    @status_errors
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(prompt=self.service.detokenize(request.tokens))

    @status_errors
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.AdapterList:
        return pb.AdapterList(names=await self.service.update_adapter(request.name, request.path))

    @status_errors
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.AdapterList:
        return pb.AdapterList(names=await self.service.update_adapter(request.name, None))

    @status_errors
    async def ListAdapters(self, request: pb.ListAdaptersRequest, context) -> pb.AdapterList:
        return pb.AdapterList(names=self.service.model_info().adapters)


def unary_methods(servicer: Gpt2ServeServicer) -> dict:
    return {
        "NextToken": (servicer.NextToken, pb.NextTokenRequest, pb.NextTokenResponse),
        "NextTokenBatch": (servicer.NextTokenBatch, pb.NextTokenBatchRequest, pb.NextTokenBatchResponse),
        "GetModelInfo": (servicer.GetModelInfo, pb.GetModelInfoRequest, pb.ModelInfo),
        "Tokenize": (servicer.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        "Detokenize": (servicer.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
        "LoadAdapter": (servicer.LoadAdapter, pb.LoadAdapterRequest, pb.AdapterList),
        "UnloadAdapter": (servicer.UnloadAdapter, pb.UnloadAdapterRequest, pb.AdapterList),
        "ListAdapters": (servicer.ListAdapters, pb.ListAdaptersRequest, pb.AdapterList),
    }


def builtin_methods(servicer: Gpt2ServeServicer) -> dict[str, GrpcMethod]:
    """The service's methods for the built-in server, by path, with lenient request parsing."""
    methods = {f"/{SERVICE_NAME}/{name}": GrpcMethod(UNARY, behaviour, lenient(request), serialize)
               for name, (behaviour, request, _) in unary_methods(servicer).items()}
    methods[f"/{SERVICE_NAME}/Generate"] = GrpcMethod(SERVER_STREAM, servicer.Generate, lenient(pb.GenerateRequest),
                                                      serialize)
    return methods


def add_servicer(servicer: Gpt2ServeServicer, server: grpc.aio.Server) -> None:
    """As the generated add_Gpt2ServeServicer_to_server, with lenient request parsing."""
    methods = unary_methods(servicer)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=lenient(request), response_serializer=response.SerializeToString)
        for name, (behaviour, request, response) in methods.items()
    }
    handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=lenient(pb.GenerateRequest),
        response_serializer=pb.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # Faster dispatch, as generated code does.


def grpc_transport(service: InferenceService, config: ServeConfig,
                   reuse_port: bool = False) -> GrpcTransport | BuiltinGrpcTransport:
    """gRPC by grpc.aio, or by the built-in server with --grpc-server builtin. `reuse_port`: the
    front ends of --workers N share the port; otherwise a port in use is an error, never shared
    with another server by chance."""
    return (BuiltinGrpcTransport if config.grpc_server == "builtin" else GrpcTransport)(service, config, reuse_port)


class ServingHealth:
    """What both gRPC servers share: health (grpc_health's servicer, `self.health`) and the stop."""

    health: health_aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


class GrpcTransport(ServingHealth):
    def __init__(self, service: InferenceService, config: ServeConfig, reuse_port: bool = False):
        interceptors = []
        if config.api_key:
            interceptors.append(GrpcAuthInterceptor(
                BearerKey(config.api_key),
                lambda context, error, method: abort_with(context, error, method, service.count_refusal)))
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", -1),  # Answers are bounded by the request limits.
            # No client can hold the server: pings at most every --grpc-min-ping-interval-s (idle
            # clients may keep their channel alive that often; a flood is sent GOAWAY after 2
            # strikes), idle connections closed, streams per connection and connections bounded.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(config.grpc_min_ping_interval_s * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_concurrent_streams", config.grpc_max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", config.grpc_max_connections),
            # A socket that never sends the HTTP/2 preface is closed then, not after gRPC's 120 s.
            ("grpc.server_handshake_timeout_ms", int(config.grpc_handshake_timeout_s * 1000)),
            ("grpc.so_reuseport", int(reuse_port)),
        ]
        if config.grpc_max_connection_idle_s > 0:
            options.append(("grpc.max_connection_idle_ms", int(config.grpc_max_connection_idle_s * 1000)))
        if config.grpc_max_connection_age_s > 0:
            # GOAWAY after this age; calls under way get the drain grace to finish.
            options += [("grpc.max_connection_age_ms", int(config.grpc_max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(config.shutdown_grace_s * 1000))]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        add_servicer(Gpt2ServeServicer(service), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        address = f"{config.host}:{config.grpc_port}"
        credentials = None
        if config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
        try:
            self.port = self.server.add_secure_port(address, credentials) if credentials else \
                self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio says only "Failed to bind"; a port in use is the common cause
            self.port = 0
        if self.port == 0:
            raise StartupError(f"gRPC cannot listen on {address}: the port is in use by another process, or the "
                               "address is not this machine's: choose another with --grpc-port (0 picks a free one) "
                               "or --host")

    async def start(self) -> None:
        await self.server.start()



class BuiltinGrpcTransport(ServingHealth):
    """The same services over transport.grpc_builtin; `listen` binds (grpc.aio binds in __init__)."""

    def __init__(self, service: InferenceService, config: ServeConfig, reuse_port: bool = False):
        self.config, self.reuse_port = config, reuse_port
        self.health = health_aio.HealthServicer()
        methods = builtin_methods(Gpt2ServeServicer(service))
        methods.update(health_methods(self.health))
        methods.update(reflection_methods(service_names(SERVICE_NAME, HEALTH_SERVICE)))
        key = BearerKey(config.api_key) if config.api_key else None

        def guard(path: str, headers) -> GrpcMethod | None:
            """In a protected method's place without the key: a refusal, counted by abort_with."""
            service_name, _, method = path.lstrip("/").partition("/")
            if key is None or service_name in OPEN_GRPC_SERVICES:
                return None
            if key.accepts(next((value for name, value in headers if name == b"authorization"), None)):
                return None

            async def deny(request, context):
                await abort_with(context, Unauthenticated(f"missing or wrong API key: {AUTH_HINT}"), method,
                                 service.count_refusal)

            # A unary refusal for streaming methods too: it answers before any message is sent.
            return GrpcMethod(UNARY, deny, bytes, bytes)

        policy = ConnectionPolicy(
            max_concurrent_streams=config.grpc_max_concurrent_streams,
            handshake_timeout_s=config.grpc_handshake_timeout_s,
            min_ping_interval_s=config.grpc_min_ping_interval_s,
            idle_timeout_s=config.grpc_max_connection_idle_s, max_age_s=config.grpc_max_connection_age_s,
            age_grace_s=config.shutdown_grace_s, send_timeout_s=config.grpc_send_timeout_s,
            connection_window=min(max(CONNECTION_WINDOW, 2 * config.max_message_bytes), MAX_WINDOW))
        app = GrpcApp(methods, config.max_message_bytes, guard, config.grpc_request_timeout_s)
        self.server = BuiltinGrpcServer(app, policy, config.grpc_max_connections,
                                        lambda: service.telemetry.connection_refused("grpc"),
                                        lambda: service.telemetry.connection_evicted("grpc"))
        self.port: int | None = None

    async def start(self) -> None:
        tls = (self.config.tls_cert, self.config.tls_key) if self.config.tls_cert else None
        self.port = await self.server.listen(self.config.host, self.config.grpc_port, tls, self.reuse_port)

