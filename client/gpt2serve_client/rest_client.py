"""REST client over httpx, with the same methods as the gRPC `Client`."""

from __future__ import annotations

from typing import Any, Sequence

import httpx

from . import _requests
from .errors import Gpt2ServeError
from .types import HealthStatus, ModelInfo, NextTokenResult

DEFAULT_TIMEOUT_S = 30.0
HTTP_TO_CODE = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 422: "INVALID_ARGUMENT",
                429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def error_from_response(response: httpx.Response) -> Gpt2ServeError:
    try:
        error = response.json()["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        code, message = HTTP_TO_CODE.get(response.status_code, "UNKNOWN"), response.text
    return Gpt2ServeError(code, message, http_status=response.status_code)


class RestClient:
    def __init__(self, base_url: str = "http://localhost:8000", *, timeout: float = DEFAULT_TIMEOUT_S,
                 http_client: httpx.Client | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = http_client or httpx.Client(base_url=self.base_url, timeout=timeout)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = self._http.request(method, path, json=body, headers=_requests.trace_headers(), **kwargs)
        except httpx.TimeoutException as exc:
            raise Gpt2ServeError("DEADLINE_EXCEEDED", str(exc) or "request timed out") from None
        except httpx.TransportError as exc:
            raise Gpt2ServeError("UNAVAILABLE", str(exc) or type(exc).__name__) from None
        if response.is_success:
            return response.json()
        raise error_from_response(response)

    def next_token(self, prompt: _requests.Prompt, top_k: int | None = 5, trace_layers: bool = False,
                   include_layers: bool = False, timeout: float | None = None) -> NextTokenResult:
        body = _requests.next_token_json(prompt, top_k, trace_layers, include_layers)
        return NextTokenResult.from_dict(self._request("POST", "/v1/next-token", body, timeout))

    def next_token_batch(self, prompts: Sequence[_requests.Prompt], top_k: int | None = 5, trace_layers: bool = False,
                         include_layers: bool = False, timeout: float | None = None) -> list[NextTokenResult]:
        body = _requests.next_token_batch_json(prompts, top_k, trace_layers, include_layers)
        data = self._request("POST", "/v1/next-token/batch", body, timeout)
        return [NextTokenResult.from_dict(r) for r in data["results"]]

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return ModelInfo.from_dict(self._request("GET", "/v1/model", timeout=timeout))

    def health(self, timeout: float | None = None) -> HealthStatus:
        """Readiness: SERVING when the model is loaded and accepting work."""
        try:
            self._request("GET", "/readyz", timeout=timeout)
        except Gpt2ServeError as exc:
            if exc.http_status == 503:
                return HealthStatus(serving=False, status="NOT_SERVING")
            raise
        return HealthStatus(serving=True, status="SERVING")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
