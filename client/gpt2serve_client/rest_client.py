"""REST client over httpx, with the same methods as the gRPC `Client`."""

from __future__ import annotations

import json
import random
import ssl
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import httpx

from . import _requests
from ._starting import ServerStarting, retry_after_s
from .errors import Gpt2ServeError
from .status import ERROR_STATUSES, code_for_http
from .generation import GenerateChunk, GenerateResult
from .types import HealthStatus, ModelInfo, NextTokenResult, TokenizeResult

DEFAULT_TIMEOUT_S = _requests.DEFAULT_TIMEOUT_S
MAX_BACKOFF_S = 2.0
RETRYABLE_HTTP_STATUS = tuple(s.http for s in ERROR_STATUSES if s.retry_after)  # 429, 503


def error_from_response(response: httpx.Response) -> Gpt2ServeError:
    try:
        error = response.json()["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        code, message = code_for_http(response.status_code), response.text
    return Gpt2ServeError(code, message, http_status=response.status_code)


def retry_delay(attempt: int, retry_after: str | None) -> float:
    """The server's Retry-After (seconds) when it gave one, else exponential backoff with jitter."""
    try:
        if retry_after:
            return min(float(retry_after), MAX_BACKOFF_S)
    except ValueError:
        pass
    return min(0.1 * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1.0)


def base_url_of(url: str) -> str:
    """A base URL from what a user may type: `host:port` means http://host:port, as `Client` takes it."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def ssl_context(root_certificates: bytes | str | Path | None) -> ssl.SSLContext | bool:
    """Verify against the system roots, or against a private CA (PEM bytes or a file path)."""
    if root_certificates is None:
        return True
    return ssl.create_default_context(cadata=_requests.read_pem(root_certificates).decode())


class RestClient:
    """REST client; the same methods as the gRPC `Client`. Calls have a deadline (`timeout`, the
    whole call with its retries) and are retried on 503 / 429 / connection failures up to
    `retries` times, after the server's Retry-After. A server that is starting (not listening yet,
    or answering 503 with Retry-After while its model loads) is waited for within the deadline
    (`wait_for_ready=False`: fail at once instead). `base_url` may be `host:port` (http://). Use
    an https:// URL for TLS, with `root_certificates` for a private CA; `api_key` is sent as
    `authorization: Bearer <key>`."""

    def __init__(self, base_url: str = "http://localhost:8000", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, root_certificates: bytes | str | Path | None = None,
                 retries: int = _requests.DEFAULT_RETRIES, http_client: httpx.Client | None = None,
                 wait_for_ready: bool = True):
        self.base_url = base_url_of(base_url)
        self.wait_for_ready = wait_for_ready
        self.timeout = timeout
        self.retries = retries
        self._api_key = api_key
        self._http = http_client or httpx.Client(base_url=self.base_url, timeout=timeout,
                                                 verify=ssl_context(root_certificates))

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = None) -> dict[str, Any]:
        timeout = self.timeout if timeout is None else timeout
        deadline, attempt = time.monotonic() + timeout, 0
        starting = ServerStarting(self.base_url, timeout) if self.wait_for_ready else None
        while True:
            try:
                return self._attempt(method, path, body, deadline)
            except _Retryable as retry:
                if starting is not None and retry.starting:  # not ready yet: waited for, within the deadline
                    delay = starting.wait_s(retry.error.message, retry_after_s(retry.retry_after),
                                            retry.error.http_status)
                else:
                    delay = retry_delay(attempt, retry.retry_after)
                    if attempt == self.retries or time.monotonic() + delay >= deadline:
                        raise retry.error from None
                    attempt += 1
                time.sleep(delay)

    def _attempt(self, method: str, path: str, body: dict[str, Any] | None, deadline: float) -> dict[str, Any]:
        headers = _requests.request_headers(self._api_key)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Gpt2ServeError("DEADLINE_EXCEEDED", "the call's deadline passed")
        try:
            response = self._http.request(method, path, json=body, headers=headers, timeout=remaining)
        except httpx.TimeoutException as exc:
            raise Gpt2ServeError("DEADLINE_EXCEEDED", str(exc) or "request timed out") from None
        except httpx.ConnectError as exc:  # not sent: the server is not listening (yet)
            raise _Retryable.not_connected(exc) from None
        except httpx.RemoteProtocolError as exc:  # the server closed the connection
            raise _Retryable(Gpt2ServeError("UNAVAILABLE", str(exc) or type(exc).__name__)) from None
        except httpx.TransportError as exc:
            raise Gpt2ServeError("UNAVAILABLE", str(exc) or type(exc).__name__) from None
        if response.is_success:
            return response.json()
        error = error_from_response(response)
        if response.status_code in RETRYABLE_HTTP_STATUS:  # whatever the body says (a proxy may have answered)
            raise _Retryable.refused(response, error)
        raise error

    def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                   include_layers: bool = False, attention_maps: bool = False, timeout: float | None = None,
                   prompt_logprobs: int | None = None, adapter: str | None = None,
                   compare_base: bool = False) -> NextTokenResult:
        body = _requests.next_token_json(prompt, top_k, trace_layers, include_layers, attention_maps, prompt_logprobs,
                                        adapter, compare_base)
        return NextTokenResult.from_dict(self._request("POST", "/v1/next-token", body, timeout))

    def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None,
                         prompt_logprobs: int | None = None, adapter: str | None = None) -> list[NextTokenResult]:
        body = _requests.next_token_batch_json(prompts, top_k, trace_layers, include_layers, prompt_logprobs, adapter)
        data = self._request("POST", "/v1/next-token/batch", body, timeout)
        return [NextTokenResult.from_dict(r) for r in data["results"]]

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
        """As the gRPC `Client.generate_stream`, over server-sent events (not retried once the
        stream has begun). Closing the iterator closes the connection, which cancels the generation."""
        body = _requests.generate_json(
            prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, logprobs=logprobs, ignore_eos=ignore_eos,
            trace_layers=trace_layers, trace_steps=trace_steps,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_p=min_p, min_tokens=min_tokens,
            json_schema=json_schema, regex=regex, choice=choice, grammar=grammar, adapter=adapter)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        starting = ServerStarting(self.base_url, timeout) if self.wait_for_ready else None
        while True:  # tried again only while the server is starting, before any token
            try:
                yield from self._stream_events(body, deadline)
                return
            except _Retryable as retry:
                if starting is None or not retry.starting:
                    raise retry.error from None
                time.sleep(starting.wait_s(retry.error.message, retry_after_s(retry.retry_after),
                                           retry.error.http_status))

    def _stream_events(self, body: dict[str, Any], deadline: float) -> Iterator[GenerateChunk]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Gpt2ServeError("DEADLINE_EXCEEDED", "the call's deadline passed")
        try:
            with self._http.stream("POST", "/v1/generate", json={**body, "stream": True}, timeout=remaining,
                                   headers=_requests.request_headers(self._api_key)) as response:
                if not response.is_success:
                    response.read()
                    refused = _Retryable.refused(response, error_from_response(response))
                    raise refused if refused.starting else refused.error  # only a starting server, before a token
                event = ""
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data = json.loads(line[5:])
                        if event == "error":
                            raise Gpt2ServeError(data["error"]["code"], data["error"]["message"])
                        yield from GenerateChunk.from_dict(data).split()  # one chunk a token
                        event = ""
        except httpx.TimeoutException as exc:
            raise Gpt2ServeError("DEADLINE_EXCEEDED", str(exc) or "request timed out") from None
        except httpx.ConnectError as exc:
            raise _Retryable.not_connected(exc) from None
        except httpx.TransportError as exc:
            raise Gpt2ServeError("UNAVAILABLE", str(exc) or type(exc).__name__) from None

    def generate(self, prompt: _requests.Prompt, timeout: float | None = None, **options) -> GenerateResult:
        """The whole generation in one JSON answer (retried like the other calls); the options
        of `generate_stream`."""
        _requests.check_options("RestClient.generate", options, RestClient.generate_stream)
        body = _requests.generate_json(prompt=prompt, **{**GENERATE_DEFAULTS, **options})
        return GenerateResult.from_dict(self._request("POST", "/v1/generate", body, timeout))

    def tokenize(self, prompt: str | None = None, *, messages: _requests.Messages | None = None,
                 add_generation_prompt: bool = True, return_token_strs: bool = False,
                 timeout: float | None = None) -> TokenizeResult:
        """As the gRPC `Client.tokenize` (POST /tokenize, vLLM's shape)."""
        body = _requests.tokenize_json(prompt, messages, add_generation_prompt, return_token_strs)
        return TokenizeResult.from_dict(self._request("POST", "/tokenize", body, timeout))

    def detokenize(self, tokens: Sequence[int], timeout: float | None = None) -> str:
        return self._request("POST", "/detokenize", {"tokens": list(tokens)}, timeout)["prompt"]

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_dict(self._request("GET", "/v1/model", timeout=timeout))

    def health(self, timeout: float | None = None) -> HealthStatus:
        """Readiness: SERVING when the model is loaded and accepting work (asked once, no retries)."""
        try:
            self._attempt("GET", "/readyz", None, time.monotonic() + (self.timeout if timeout is None else timeout))
        except _Retryable as retry:
            if retry.error.http_status != 503:
                raise retry.error from None
            return HealthStatus(serving=False, status="NOT_SERVING")
        return HealthStatus(serving=True, status="SERVING")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


GENERATE_DEFAULTS: dict[str, Any] = dict(max_tokens=16, temperature=None, top_k=None, top_p=None, seed=None,
                                         stop=None, stop_token_ids=None, logprobs=0, ignore_eos=False,
                                         trace_layers=False)


class _Retryable(Exception):
    """A failed attempt worth repeating (the server was unavailable or overloaded)."""

    def __init__(self, error: Gpt2ServeError, retry_after: str | None = None, starting: bool = False):
        self.error = error
        self.retry_after = retry_after
        self.starting = starting  # the server is not ready yet (see _starting.py)

    @classmethod
    def not_connected(cls, exc: httpx.ConnectError) -> _Retryable:
        return cls(Gpt2ServeError("UNAVAILABLE", f"could not connect: {exc or type(exc).__name__}"), starting=True)

    @classmethod
    def refused(cls, response: httpx.Response, error: Gpt2ServeError) -> _Retryable:
        """503 with Retry-After is a server starting: its model still loading, or a restart (the
        next server not up yet)."""
        retry_after = response.headers.get("retry-after")
        return cls(error, retry_after, starting=response.status_code == 503 and retry_after is not None)
