"""The next-token routes answered straight from the HTTP protocol, not through ASGI.

A REST next-token call spent most of a front end's CPU between the socket and the route:
uvicorn's ASGI cycle and its middleware, the guard's wrapper, Starlette's Request, a watcher
task for the hang-up, and two writes an answer (docs/benchmarks.md, "REST answered from the
protocol"). For the routes of `InferenceRoutes` marked `direct`, the front end's protocol
(transport.http_connections) hands the request's cycle here instead: the body uvicorn buffered
is read, the guard's checks and the route run, and the answer goes out in one write. A hang-up
cancels the route's task from `connection_lost`, which the service counts CANCELLED.

Pipelining, keep-alive, `Expect: 100-continue`, flow control and the graceful shutdown's wait
stay uvicorn's: the cycle is its own, and the task is in its set.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from .guard import Headers, HttpGuard
from .http_errors import HttpErrors, as_serve_error, parse_body

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]


@dataclass(slots=True)  # not frozen: made per request (see protocol.PER_REQUEST)
class CallHead:
    """What a route reads of the request besides its body: the headers (lower-case names, as
    the parser gave them) and the scheme."""

    headers: Iterable[tuple[bytes, bytes]]
    scheme: str = "http"

    @classmethod
    def of(cls, scope: dict) -> CallHead:
        """An ASGI scope's (uvicorn's request cycle and Starlette's Request carry one)."""
        return cls(scope["headers"], scope.get("scheme", "http"))

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class DirectRoute:
    body_type: Any  # the pydantic model of the body
    handler: Callable[[CallHead, Any], Awaitable[bytes]]  # the answer's JSON


class DirectRoutes:
    def __init__(self, routes: dict[str, DirectRoute], guard: HttpGuard, errors: HttpErrors,
                 accepted: Callable[[str], Any]):
        """`accepted(name)`: the service's context held while a call is served (the drain waits for it)."""
        self.routes = routes
        self.paths = frozenset(routes)
        self.guard, self.errors, self.accepted = guard, errors, accepted

    async def serve(self, cycle: RequestResponseCycle) -> None:
        """Answer the cycle's request (a POST to one of `paths`); nothing when the client hung up."""
        path = cycle.scope["path"]
        with self.accepted(f"POST {path}"):  # until the answer is written
            try:
                status, headers, body = await self.answer(cycle, path)
            except asyncio.CancelledError:
                if not cycle.disconnected:
                    raise  # a shutdown's cancel: uvicorn's to handle
                asyncio.current_task().uncancel()
                return  # Nobody to answer; the service counted it.
            await write(cycle, status, headers, body)

    async def answer(self, cycle: RequestResponseCycle, path: str) -> tuple[int, Headers, bytes]:
        head = CallHead.of(cycle.scope)
        route = self.routes[path]
        extra: Headers = []
        try:
            refusal = self.guard.refusal(path, head.headers)
            if refusal is not None:
                error, extra = refusal
                raise error
            raw = await read_whole(cycle, self.guard)
            body = parse_body(raw, head.header(b"content-type"), route.body_type)
            return 200, JSON_HEADERS, await route.handler(head, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every refusal and failure, rendered and counted one way
            status, headers, body = self.errors.render(path, as_serve_error(exc, path))
            return status, headers + extra, body


async def read_whole(cycle: RequestResponseCycle, guard: HttpGuard) -> bytes:
    """The request's body, whole (most often already in: it came with the headers). Raises the
    guard's PayloadTooLarge past its limit, so a chunked body cannot grow without end."""
    limit = guard.max_body_bytes
    parts = []
    size = 0
    while True:
        message = await cycle.receive()  # resumes reading, answers Expect: 100-continue
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError()  # the protocol cancels this task as well
        parts.append(message["body"])
        size += len(message["body"])
        if size > limit:
            raise guard.too_large()
        if not message["more_body"]:
            return b"".join(parts)


async def write(cycle: RequestResponseCycle, status: int, headers: Headers, body: bytes) -> None:
    """The answer in one write: status line, uvicorn's default headers (date, server), the
    route's, content-length; the connection closes after it unless kept alive."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    if headers is not JSON_HEADERS and (b"connection", b"close") in headers:
        cycle.keep_alive = False  # a refusal before the body was read (the guard's): the rest is not wanted
    content = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers):
        if name not in (b"content-length", b"connection"):
            content += (name, b": ", value, b"\r\n")
    content.append(b"content-length: %d\r\n" % len(body))
    if not cycle.keep_alive:
        content.append(b"connection: close\r\n")
    content += (b"\r\n", body)
    cycle.transport.write(b"".join(content))
    cycle.response_started = cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    on_response, cycle.on_response = cycle.on_response, lambda: None
    on_response()
