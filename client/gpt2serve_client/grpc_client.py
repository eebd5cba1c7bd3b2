"""gRPC clients: `Client` (blocking) and `AsyncClient` (asyncio), with the same methods."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._proto import gpt2serve_pb2 as pb
from ._proto import gpt2serve_pb2_grpc as pb_grpc
from ._grpc_attempts import Attempts, error_of
from ._starting import ServerStarting
from .errors import Gpt2ServeError
from .generation import GenerateChunk, GenerateResult
from .types import HealthStatus, ModelInfo, NextTokenResult, TokenizeResult

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
    """gRPC's own retry policy (retries > 0): UNAVAILABLE and RESOURCE_EXHAUSTED are retried with
    exponential backoff (and the server's grpc-retry-pushback-ms), within the call's deadline. Each attempt
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
    # Retries stay enabled without a policy too: that keeps gRPC's transparent retry of a stream
    # the server refused unopened (past its --grpc-max-concurrent-streams on a connection that has
    # just opened), which would otherwise reach the caller as UNAVAILABLE.
    options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config)),
                ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_RESOLUTION_INTERVAL_MS),
                # A server that is starting is connected within about a second of opening its port
                # (gRPC's own backoff grows to 120 s, so a late start would be seen late).
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
    return options


def tls_credentials(tls: bool, root_certificates: bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    """None for plaintext; with TLS, the system roots unless `root_certificates` (PEM bytes or path)."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_requests.read_pem(root_certificates))


class Client:
    """Blocking gRPC client. Every call has a deadline (`timeout` seconds unless overridden) and
    is retried on UNAVAILABLE / RESOURCE_EXHAUSTED up to `retries` times within it. A server that
    is starting (its port not open yet, or its model still loading) is waited for within the
    deadline (`wait_for_ready=False`: fail at once instead).

    `api_key` is sent as `authorization: Bearer <key>`; `tls=True` (or `root_certificates`, PEM
    bytes or a file path, for a private CA) connects over TLS.

    Several replicas: give a `dns:///name:port` target (e.g. a Kubernetes headless Service) and
    each call goes to the next replica the name resolves to (`load_balancing="round_robin"`, the
    default for dns: targets); the name is resolved again when a connection closes, so replicas
    that come and go are followed (see the server's --grpc-max-connection-age-s)."""

    def __init__(self, target: str = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, tls: bool = False, root_certificates: bytes | str | Path | None = None,
                 retries: int = _requests.DEFAULT_RETRIES, channel: grpc.Channel | None = None,
                 load_balancing: str | None = None, wait_for_ready: bool = True):
        self.target = target
        self.wait_for_ready = wait_for_ready
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

    def _new_attempts(self, failovers: int, timeout: float | None, wait: bool = True) -> Attempts:
        timeout = self.timeout if timeout is None else timeout
        starting = ServerStarting(self.target, timeout) if self.wait_for_ready and wait else None
        return Attempts(failovers, timeout, starting)

    def _call(self, method, request, timeout: float | None, wait: bool = True):
        """`wait`: for a server that is starting (see _starting.py)."""
        attempts = self._new_attempts(self._attempts, timeout, wait)
        while True:
            try:
                return method(request, timeout=attempts.timeout(), metadata=self._metadata(),
                              wait_for_ready=attempts.wait_for_ready)
            except grpc.RpcError as exc:
                time.sleep(attempts.wait_or_raise(exc))

    def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                   include_layers: bool = False, attention_maps: bool = False, timeout: float | None = None,
                   prompt_logprobs: int | None = None, adapter: str | None = None,
                   compare_base: bool = False) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers, attention_maps,
                                             prompt_logprobs, adapter, compare_base)
        return NextTokenResult.from_proto(self._call(self._stub.NextToken, request, timeout))

    def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None,
                         prompt_logprobs: int | None = None, adapter: str | None = None) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers, prompt_logprobs,
                                                   adapter)
        response = self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    def generate_stream(self, prompt: _requests.Prompt, max_tokens: int | None = 16, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                        logprobs: int = 0, ignore_eos: bool = False, trace_layers: bool = False,
                        trace_steps: bool = False, presence_penalty: float | None = None, frequency_penalty: float | None = None,
                        repetition_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
                        min_p: float | None = None, min_tokens: int | None = None,
                        json_schema: Mapping[str, Any] | str | None = None, regex: str | None = None,
                        choice: Sequence[str] | None = None, grammar: str | None = None,
                        adapter: str | None = None, timeout: float | None = None) -> Iterator[GenerateChunk]:
        """The generation as it goes: a GenerateChunk per token, then a closing one with the
        finish reason and usage. temperature 0 is greedy; the same seed, the same text.
        The penalties, logit_bias (token id -> bias), min_p and min_tokens control each step's
        logits; json_schema (a dict or its JSON), regex, choice or grammar (Lark or GBNF)
        constrain the output to match (docs/generation.md has the formulas and rules).
        Breaking out of the loop (or closing it) cancels the generation on the server."""
        request = _requests.generate_proto(
            prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs, ignore_eos=ignore_eos,
            trace_layers=trace_layers, trace_steps=trace_steps,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_p=min_p, min_tokens=min_tokens,
            json_schema=json_schema, regex=regex, choice=choice, grammar=grammar, adapter=adapter)
        attempts = self._new_attempts(1, timeout)  # no failover: refused streams and a starting server only
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata(),
                                       wait_for_ready=attempts.wait_for_ready)
            started = False
            try:
                for message in call:
                    started = True
                    yield from GenerateChunk.from_proto(message).split()  # one chunk a token
                return
            except grpc.RpcError as exc:
                wait = attempts.wait_or_raise(exc, resend=not started)  # once a token came, never again
            finally:
                call.cancel()
            time.sleep(wait)

    def generate(self, prompt: _requests.Prompt, **options) -> GenerateResult:
        """The whole generation once it is done; the options of `generate_stream`."""
        _requests.check_options("Client.generate", options, Client.generate_stream)
        return GenerateResult.from_chunks(self.generate_stream(prompt, **options))

    def tokenize(self, prompt: str | None = None, *, messages: _requests.Messages | None = None,
                 add_generation_prompt: bool = True, return_token_strs: bool = False,
                 timeout: float | None = None) -> TokenizeResult:
        """A text's token ids as the model reads them, or a conversation's (`messages`) through the
        server's chat template; no length limit applies, so a prompt can be counted before it is sent."""
        request = _requests.tokenize_proto(prompt, messages, add_generation_prompt, return_token_strs)
        return TokenizeResult.from_proto(self._call(self._stub.Tokenize, request, timeout))

    def detokenize(self, tokens: Sequence[int], timeout: float | None = None) -> str:
        """Token ids back to their text."""
        return self._call(self._stub.Detokenize, pb.DetokenizeRequest(tokens=list(tokens)), timeout).prompt

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_proto(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def load_adapter(self, name: str, path: str, timeout: float | None = None) -> list[str]:
        """Load the LoRA adapter in directory `path` (on the server) as `name`; the adapters served
        after. The server must allow it (--allow-runtime-lora-updating)."""
        return list(self._call(self._stub.LoadAdapter, pb.LoadAdapterRequest(name=name, path=path), timeout).names)

    def unload_adapter(self, name: str, timeout: float | None = None) -> list[str]:
        return list(self._call(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name), timeout).names)

    def list_adapters(self, timeout: float | None = None) -> list[str]:
        return list(self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(), timeout).names)

    def health(self, timeout: float | None = None) -> HealthStatus:
        """Readiness as the server says it, asked at once (as RestClient.health): a server not
        listening yet is UNAVAILABLE, not waited for; one loading is NOT_SERVING."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout, wait=False)
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
                 load_balancing: str | None = None, wait_for_ready: bool = True):
        self.target = target
        self.wait_for_ready = wait_for_ready
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
    _new_attempts = Client._new_attempts

    async def _call(self, method, request, timeout: float | None, wait: bool = True):
        attempts = self._new_attempts(self._attempts, timeout, wait)
        while True:
            try:
                return await method(request, timeout=attempts.timeout(), metadata=self._metadata(),
                                    wait_for_ready=attempts.wait_for_ready)
            except grpc.RpcError as exc:
                await asyncio.sleep(attempts.wait_or_raise(exc))

    async def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, attention_maps: bool = False, timeout: float | None = None,
                         prompt_logprobs: int | None = None, adapter: str | None = None,
                         compare_base: bool = False) -> NextTokenResult:
        request = _requests.next_token_proto(prompt, top_k, trace_layers, include_layers, attention_maps,
                                             prompt_logprobs, adapter, compare_base)
        return NextTokenResult.from_proto(await self._call(self._stub.NextToken, request, timeout))

    async def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5,
                               trace_layers: bool = False, include_layers: bool = False,
                               timeout: float | None = None, prompt_logprobs: int | None = None,
                               adapter: str | None = None
                               ) -> list[NextTokenResult]:
        request = _requests.next_token_batch_proto(prompts, top_k, trace_layers, include_layers, prompt_logprobs,
                                                   adapter)
        response = await self._call(self._stub.NextTokenBatch, request, timeout)
        return [NextTokenResult.from_proto(r) for r in response.results]

    async def generate_stream(self, prompt: _requests.Prompt, max_tokens: int | None = 16,
                              temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                              seed: int | None = None, stop: str | Sequence[str] | None = None,
                              stop_token_ids: Sequence[int] | None = None, logprobs: int = 0, ignore_eos: bool = False,
                              trace_layers: bool = False, trace_steps: bool = False,
                              presence_penalty: float | None = None, frequency_penalty: float | None = None,
                              repetition_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
                              min_p: float | None = None, min_tokens: int | None = None,
                              json_schema: Mapping[str, Any] | str | None = None, regex: str | None = None,
                              choice: Sequence[str] | None = None, grammar: str | None = None,
                              adapter: str | None = None, timeout: float | None = None) -> AsyncIterator[GenerateChunk]:
        """As `Client.generate_stream`, asynchronously."""
        request = _requests.generate_proto(
            prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs, ignore_eos=ignore_eos,
            trace_layers=trace_layers, trace_steps=trace_steps,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_p=min_p, min_tokens=min_tokens,
            json_schema=json_schema, regex=regex, choice=choice, grammar=grammar, adapter=adapter)
        attempts = self._new_attempts(1, timeout)  # no failover: refused streams and a starting server only
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata(),
                                       wait_for_ready=attempts.wait_for_ready)
            started = False
            try:
                async for message in call:
                    started = True
                    for chunk in GenerateChunk.from_proto(message).split():  # one chunk a token
                        yield chunk
                return
            except grpc.RpcError as exc:
                wait = attempts.wait_or_raise(exc, resend=not started)  # once a token came, never again
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def generate(self, prompt: _requests.Prompt, **options) -> GenerateResult:
        """The whole generation once it is done; the options of `generate_stream`."""
        _requests.check_options("AsyncClient.generate", options, AsyncClient.generate_stream)
        return GenerateResult.from_chunks([chunk async for chunk in self.generate_stream(prompt, **options)])

    async def tokenize(self, prompt: str | None = None, *, messages: _requests.Messages | None = None,
                       add_generation_prompt: bool = True, return_token_strs: bool = False,
                       timeout: float | None = None) -> TokenizeResult:
        """As `Client.tokenize`, awaited."""
        request = _requests.tokenize_proto(prompt, messages, add_generation_prompt, return_token_strs)
        return TokenizeResult.from_proto(await self._call(self._stub.Tokenize, request, timeout))

    async def detokenize(self, tokens: Sequence[int], timeout: float | None = None) -> str:
        return (await self._call(self._stub.Detokenize, pb.DetokenizeRequest(tokens=list(tokens)), timeout)).prompt

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_proto(await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def load_adapter(self, name: str, path: str, timeout: float | None = None) -> list[str]:
        request = pb.LoadAdapterRequest(name=name, path=path)
        return list((await self._call(self._stub.LoadAdapter, request, timeout)).names)

    async def unload_adapter(self, name: str, timeout: float | None = None) -> list[str]:
        return list((await self._call(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name), timeout)).names)

    async def list_adapters(self, timeout: float | None = None) -> list[str]:
        return list((await self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(), timeout)).names)

    async def health(self, timeout: float | None = None) -> HealthStatus:
        response = await self._call(self._health.Check, health_pb2.HealthCheckRequest(), timeout, wait=False)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return HealthStatus(serving=status == "SERVING", status=status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
