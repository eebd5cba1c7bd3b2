"""gRPC clients: `Client` (blocking) and `AsyncClient` (asyncio), with the same methods."""

from __future__ import annotations

from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._proto import gpt2serve_pb2 as pb
from ._proto import gpt2serve_pb2_grpc as pb_grpc
from .errors import Gpt2ServeError
from .types import HealthStatus, ModelInfo, NextTokenResult

DEFAULT_TIMEOUT_S = 30.0


def _error(exc: grpc.RpcError) -> Gpt2ServeError:
    return Gpt2ServeError(exc.code().name, exc.details() or "")


def _metadata() -> tuple[tuple[str, str], ...] | None:
    return tuple(_requests.trace_headers().items()) or None


class Client:
    """Blocking gRPC client. Every call has a deadline (`timeout` seconds unless overridden)."""

    def __init__(self, target: str = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT_S,
                 channel: grpc.Channel | None = None):
        self.target = target
        self.timeout = timeout
        self._channel = channel or grpc.insecure_channel(target)
        self._stub = pb_grpc.Gpt2ServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=_metadata())
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                   include_layers: bool = False, timeout: float | None = None) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers)
        return NextTokenResult.from_proto(self._call(self._stub.NextToken, request, timeout))

    def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers)
        response = self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_proto(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, timeout: float | None = None) -> HealthStatus:
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return HealthStatus(serving=status == "SERVING", status=status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio gRPC client; the same methods as `Client`, awaited."""

    def __init__(self, target: str = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT_S,
                 channel: grpc.aio.Channel | None = None):
        self.target = target
        self.timeout = timeout
        self._channel = channel or grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.Gpt2ServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _call(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout, metadata=_metadata())
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers)
        return NextTokenResult.from_proto(await self._call(self._stub.NextToken, request, timeout))

    async def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5,
                               trace_layers: bool = False, include_layers: bool = False,
                               timeout: float | None = None) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers)
        response = await self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_proto(await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, timeout: float | None = None) -> HealthStatus:
        response = await self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return HealthStatus(serving=status == "SERVING", status=status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
