"""The gRPC transport: servicer, health, reflection. Translation only; rules live in service.py."""

from __future__ import annotations

import functools
import logging

import grpc
from opentelemetry import propagate
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc

from ..errors import ServeError
from ..service import InferenceService, PromptInput, RequestOptions

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gpt2Serve"].full_name


def status_errors(method):
    """Turn ServeError into its gRPC status; anything else is INTERNAL, logged, never a crash."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except ServeError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see server log")

    return wrapper


def prompt_input(msg: pb.NextTokenRequest | pb.Prompt) -> PromptInput:
    return PromptInput(text=msg.prompt, token_ids=list(msg.prompt_token_ids))


def request_options(method: str, request, context: grpc.aio.ServicerContext) -> RequestOptions:
    """Span name and attributes, the caller's W3C trace context (metadata), and what it asked to see."""
    metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
    return RequestOptions(
        api="grpc", method=method, span_name=f"{SERVICE_NAME}/{method}", parent=propagate.extract(metadata),
        attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method},
        trace_layers=request.trace_layers, include_layers=request.include_layers,
    )


class Gpt2ServeServicer(pb_grpc.Gpt2ServeServicer):
    def __init__(self, service: InferenceService):
        self.service = service

    @status_errors
    async def NextToken(self, request: pb.NextTokenRequest, context) -> pb.NextTokenResponse:
        top_k = request.top_k if request.HasField("top_k") else None
        options = request_options("NextToken", request, context)
        result = await self.service.next_token(prompt_input(request), top_k, options)
        return result.to_proto()

    @status_errors
    async def NextTokenBatch(self, request: pb.NextTokenBatchRequest, context) -> pb.NextTokenBatchResponse:
        top_k = request.top_k if request.HasField("top_k") else None
        options = request_options("NextTokenBatch", request, context)
        results = await self.service.next_token_batch([prompt_input(p) for p in request.prompts], top_k, options)
        return pb.NextTokenBatchResponse(results=[r.to_proto() for r in results])

    @status_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.service.model_info().to_proto()


class GrpcTransport:
    def __init__(self, service: InferenceService, host: str, port: int):
        self.server = grpc.aio.server()
        pb_grpc.add_Gpt2ServeServicer_to_server(Gpt2ServeServicer(service), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"gRPC could not bind {host}:{port}")

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
