"""What both transports check before a request reaches the service: the API key and the size.

- `BearerKey`: `authorization: Bearer <key>`, compared in constant time.
- gRPC: `GrpcAuthInterceptor`; message size is grpc's own `max_receive_message_length`.
- REST: `HttpGuard`, an ASGI wrapper: 401 without the key, 413 for a body over the limit
  (by Content-Length, or counted while a chunked body streams in: the route reading it answers).

Health probes stay open (`/healthz`, `/readyz`, grpc.health.v1, reflection), and so do the
OpenAPI docs, which describe the API and hold no data; `/metrics` is open unless asked.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Iterable

import grpc

from ..errors import PayloadTooLarge, ServeError, Unauthenticated
from .http_errors import HttpErrors
from .ui import PAGE_PATHS, PAGE_PREFIXES

OPEN_HTTP_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"}) | PAGE_PATHS
OPEN_GRPC_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                "grpc.reflection.v1.ServerReflection"})
AUTH_HINT = "send 'authorization: Bearer <key>'"

Headers = list[tuple[bytes, bytes]]  # (name, value), names in lower case
# abort(context, error, method): answers a call with its error status and counts it
# (grpc_server.abort_with, the one place gRPC refusals are counted).
Abort = Callable[[grpc.aio.ServicerContext, Exception, str], Awaitable[None]]


class BearerKey:
    def __init__(self, key: str):
        self._key = key.encode()

    def accepts(self, authorization: str | bytes | None) -> bool:
        """True for `Bearer <key>` (scheme case-insensitive); the key is compared in constant time."""
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        scheme, _, token = authorization.strip().partition(b" ")
        # compare_digest takes as long for a wrong key of the right length as for the right key.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to protected services without the key, before the request is even parsed."""

    def __init__(self, key: BearerKey, abort: Abort):
        self.key = key
        self.abort = abort

    async def intercept_service(self, continuation, handler_call_details):
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if service in OPEN_GRPC_SERVICES:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        if self.key.accepts(authorization):
            return await continuation(handler_call_details)

        async def deny(request, context: grpc.aio.ServicerContext):
            await self.abort(context, Unauthenticated(f"missing or wrong API key: {AUTH_HINT}"), method)

        # A unary handler refuses streaming methods too: it aborts before any message is read or sent.
        return grpc.unary_unary_rpc_method_handler(deny)


class HttpGuard:
    """ASGI wrapper: API key (when configured) and the body size limit, for every HTTP path.
    Its refusals are answered and counted by transport.http_errors, like every other."""

    def __init__(self, app, *, key: BearerKey | None, max_body_bytes: int, metrics_open: bool, errors: HttpErrors):
        self.app = app
        self.key = key
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_HTTP_PATHS | ({"/metrics"} if metrics_open else set())
        self.errors = errors

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope.get("path", ""), scope.get("headers") or ())
        if refusal is not None:
            error, headers = refusal
            return await self.errors.send(scope, send, error, headers)
        limit, received = self.max_body_bytes, 0

        async def counted_receive():
            """A chunked body has no Content-Length: count it as it arrives (routes answer the error)."""
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self.too_large()
            return message

        await self.app(scope, counted_receive, send)

    def refusal(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> tuple[ServeError, Headers] | None:
        """Why a request is refused before its body is read, with the answer's extra headers; None
        if it is not. `headers`: the request's, names in lower case."""
        authorization, length = None, b"0"
        for name, value in headers:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = value
        open_path = path in self.open_paths or path.startswith(PAGE_PREFIXES)
        if self.key is not None and not open_path and not self.key.accepts(authorization):
            return Unauthenticated(f"missing or wrong API key: {AUTH_HINT}"), [(b"www-authenticate", b"Bearer")]
        try:
            declared = int(length)
        except ValueError:
            declared = 0
        if declared > self.max_body_bytes:
            return self.too_large(), [(b"connection", b"close")]
        return None

    def too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the body exceeds {self.max_body_bytes} bytes (--max-message-bytes)")
