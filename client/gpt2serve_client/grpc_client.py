"""gRPC clients: `Client` (blocking) and `AsyncClient` (asyncio), with the same methods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._proto import gpt2serve_pb2 as pb
from ._proto import gpt2serve_pb2_grpc as pb_grpc
from .errors import Gpt2ServeError
from .generation import GenerateChunk, GenerateResult
from .types import HealthStatus, ModelInfo, NextTokenResult

DEFAULT_TIMEOUT_S = _requests.DEFAULT_TIMEOUT_S
MAX_RESPONSE_BYTES = 256 * 1024 * 1024  # include_layers on a big batch of a big model is large
# A dns: target is resolved again when a connection closes (a replica left, or the server's
# --grpc-max-connection-age-s), at most this often; gRPC's own default is 30 s, which would
# leave a new replica idle that long in a rolling update.
DNS_MIN_RESOLUTION_INTERVAL_MS = 2000
# Round-robin over replicas: a unary call refused UNAVAILABLE (a replica draining, or gone in
# the instant before its health check said so) is tried again, on the next replica, this many
# times in all. gRPC's own retries cannot: a draining server asks them not to retry (pushback).
FAILOVER_ATTEMPTS = 3


def default_load_balancing(target: str) -> str:
    """round_robin for a `dns:///name:port` target (every replica the name resolves to, a call
    each in turn), gRPC's own pick_first (one connection) otherwise."""
    return "round_robin" if target.startswith("dns:") else "pick_first"


def channel_options(retries: int, load_balancing: str = "pick_first") -> list[tuple[str, object]]:
    """gRPC's own retry policy: UNAVAILABLE and RESOURCE_EXHAUSTED are retried with exponential
    backoff (and the server's grpc-retry-pushback-ms), within the call's deadline. Each attempt
    is picked again by the load balancer, so under round_robin a retry goes to another replica."""
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
    config: dict = {"loadBalancingConfig": [{load_balancing: {}}]}
    if load_balancing == "round_robin":
        # Client-side health checking: a replica whose gRPC health is NOT_SERVING (loading, or
        # draining after SIGTERM; it mirrors /readyz) gets no new calls while it stays connected.
        config["healthCheckConfig"] = {"serviceName": "gpt2serve.v1.Gpt2Serve"}
    if retries > 0:
        policy = {"maxAttempts": min(retries + 1, 5), "initialBackoff": "0.1s", "maxBackoff": "2s",
                  "backoffMultiplier": 2, "retryableStatusCodes": list(_requests.RETRYABLE)}
        config["methodConfig"] = [{"name": [{"service": "gpt2serve.v1.Gpt2Serve"}], "retryPolicy": policy}]
    options += [("grpc.enable_retries", int(retries > 0)), ("grpc.service_config", json.dumps(config)),
                ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_RESOLUTION_INTERVAL_MS)]
    return options


def tls_credentials(tls: bool, root_certificates: bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    """None for plaintext; with TLS, the system roots unless `root_certificates` (PEM bytes or path)."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_requests.read_pem(root_certificates))


def _error(exc: grpc.RpcError) -> Gpt2ServeError:
    if exc.code() == grpc.StatusCode.CANCELLED:
        # Our callers cancel by cancelling their task (CancelledError), never through a status:
        # a CANCELLED status comes from the other side, e.g. a retry that met a closing server.
        # Callers should fail over, as for any unavailable server.
        return Gpt2ServeError("UNAVAILABLE", f"the server cancelled the call: {exc.details() or 'no details'}")
    return Gpt2ServeError(exc.code().name, exc.details() or "")


class Client:
    """Blocking gRPC client. Every call has a deadline (`timeout` seconds unless overridden) and
    is retried on UNAVAILABLE / RESOURCE_EXHAUSTED up to `retries` times within it.

    `api_key` is sent as `authorization: Bearer <key>`; `tls=True` (or `root_certificates`, PEM
    bytes or a file path, for a private CA) connects over TLS.

    Several replicas: give a `dns:///name:port` target (e.g. a Kubernetes headless Service) and
    each call goes to the next replica the name resolves to (`load_balancing="round_robin"`, the
    default for dns: targets); the name is resolved again when a connection closes, so replicas
    that come and go are followed (see the server's --grpc-max-connection-age-s)."""

    def __init__(self, target: str = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, tls: bool = False, root_certificates: bytes | str | Path | None = None,
                 retries: int = _requests.DEFAULT_RETRIES, channel: grpc.Channel | None = None,
                 load_balancing: str | None = None):
        self.target = target
        self.timeout = timeout
        self._api_key = api_key
        credentials = tls_credentials(tls, root_certificates)
        load_balancing = load_balancing or default_load_balancing(target)
        options = channel_options(retries, load_balancing)
        self._attempts = FAILOVER_ATTEMPTS if load_balancing == "round_robin" and retries > 0 else 1
        self._channel = channel or (grpc.secure_channel(target, credentials, options) if credentials
                                    else grpc.insecure_channel(target, options))
        self._stub = pb_grpc.Gpt2ServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return tuple(_requests.request_headers(self._api_key).items()) or None

    def _call(self, method, request, timeout: float | None):
        for attempt in range(1, self._attempts + 1):
            try:
                return method(request, timeout=self.timeout if timeout is None else timeout,
                              metadata=self._metadata())
            except grpc.RpcError as exc:
                error = _error(exc)
                if error.code != "UNAVAILABLE" or attempt == self._attempts:
                    raise error from None

    def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                   include_layers: bool = False, attention_maps: bool = False, timeout: float | None = None,
                   prompt_logprobs: int | None = None) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers, attention_maps,
                                             prompt_logprobs)
        return NextTokenResult.from_proto(self._call(self._stub.NextToken, request, timeout))

    def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None,
                         prompt_logprobs: int | None = None) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers, prompt_logprobs)
        response = self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    def generate_stream(self, prompt: _requests.Prompt, max_tokens: int | None = 16, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                        logprobs: int = 0, ignore_eos: bool = False, trace_layers: bool = False,
                        trace_steps: bool = False, timeout: float | None = None) -> Iterator[GenerateChunk]:
        """The generation as it goes: a GenerateChunk per token, then a closing one with the
        finish reason and usage. temperature 0 is greedy; the same seed, the same text.
        Breaking out of the loop (or closing it) cancels the generation on the server."""
        request = _requests.generate_proto(
            prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs, ignore_eos=ignore_eos,
            trace_layers=trace_layers, trace_steps=trace_steps)
        call = self._stub.Generate(request, timeout=self.timeout if timeout is None else timeout,
                                   metadata=self._metadata())
        try:
            for message in call:
                yield GenerateChunk.from_proto(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    def generate(self, prompt: _requests.Prompt, **options) -> GenerateResult:
        """The whole generation once it is done; the options of `generate_stream`."""
        return GenerateResult.from_chunks(self.generate_stream(prompt, **options))

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
    """asyncio gRPC client; the same methods and options as `Client`, awaited."""

    def __init__(self, target: str = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, tls: bool = False, root_certificates: bytes | str | Path | None = None,
                 retries: int = _requests.DEFAULT_RETRIES, channel: grpc.aio.Channel | None = None,
                 load_balancing: str | None = None):
        self.target = target
        self.timeout = timeout
        self._api_key = api_key
        credentials = tls_credentials(tls, root_certificates)
        load_balancing = load_balancing or default_load_balancing(target)
        options = channel_options(retries, load_balancing)
        self._attempts = FAILOVER_ATTEMPTS if load_balancing == "round_robin" and retries > 0 else 1
        self._channel = channel or (grpc.aio.secure_channel(target, credentials, options) if credentials
                                    else grpc.aio.insecure_channel(target, options))
        self._stub = pb_grpc.Gpt2ServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    _metadata = Client._metadata

    async def _call(self, method, request, timeout: float | None):
        for attempt in range(1, self._attempts + 1):
            try:
                return await method(request, timeout=self.timeout if timeout is None else timeout,
                                    metadata=self._metadata())
            except grpc.RpcError as exc:
                error = _error(exc)
                if error.code != "UNAVAILABLE" or attempt == self._attempts:
                    raise error from None

    async def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, attention_maps: bool = False, timeout: float | None = None,
                         prompt_logprobs: int | None = None) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers, attention_maps,
                                             prompt_logprobs)
        return NextTokenResult.from_proto(await self._call(self._stub.NextToken, request, timeout))

    async def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5,
                               trace_layers: bool = False, include_layers: bool = False,
                               timeout: float | None = None, prompt_logprobs: int | None = None
                               ) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers, prompt_logprobs)
        response = await self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    async def generate_stream(self, prompt: _requests.Prompt, max_tokens: int | None = 16,
                              temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                              seed: int | None = None, stop: str | Sequence[str] | None = None,
                              stop_token_ids: Sequence[int] | None = None, logprobs: int = 0, ignore_eos: bool = False,
                              trace_layers: bool = False, trace_steps: bool = False,
                              timeout: float | None = None) -> AsyncIterator[GenerateChunk]:
        """As `Client.generate_stream`, asynchronously."""
        request = _requests.generate_proto(
            prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs, ignore_eos=ignore_eos,
            trace_layers=trace_layers, trace_steps=trace_steps)
        call = self._stub.Generate(request, timeout=self.timeout if timeout is None else timeout,
                                   metadata=self._metadata())
        try:
            async for message in call:
                yield GenerateChunk.from_proto(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: _requests.Prompt, **options) -> GenerateResult:
        """The whole generation once it is done; the options of `generate_stream`."""
        return GenerateResult.from_chunks([chunk async for chunk in self.generate_stream(prompt, **options)])

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
