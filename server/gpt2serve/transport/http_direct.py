"""The inference routes answered straight from the HTTP protocol, not through ASGI.

A REST next-token call spent most of a front end's CPU between the socket and the route:
uvicorn's ASGI cycle and its middleware, the guard's wrapper, Starlette's Request, a watcher
task for the hang-up, and two writes an answer (docs/benchmarks.md, "REST answered from the
protocol"); a stream added Starlette's StreamingResponse (an anyio task group and a task that
listens for the hang-up) and an ASGI message a chunk. For the routes of `InferenceRoutes`, the
front end's protocol (transport.http_connections) takes the request at its headers as a
`DirectCall` instead of uvicorn's scope and request cycle: the guard's checks run there, the
body is gathered as the parser gives it, and once it is whole one task runs the route. A route
answers JSON (written in one write) or an `EventStream` (server-sent events, each written as it
comes, chunked). A hang-up cancels that task from `connection_lost`, which the service counts
CANCELLED.

Pipelining, keep-alive, `Expect: 100-continue`, flow control and the graceful shutdown's wait
follow uvicorn's protocol, whose pipeline and task set the calls join.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from .guard import Headers, HttpGuard
from .http_errors import HttpErrors, as_serve_error, parse_body

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
# As Starlette's StreamingResponse had them (it adds the charset to a text/ type).
SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventStream:
    """A route's answer as server-sent events (each item one or more whole events, sent with
    SSE_HEADERS), sent as they come. The route has waited for what can still fail as an HTTP
    error (the first chunk); later errors are events of the stream's own."""

    events: AsyncIterator[bytes]
    # A stream whose token events may be sent as they come, without waking the task that
    # iterates `events`: (its follow, the token event's encoder). See GenerationStream.follow.
    push: tuple[Callable[[Callable | None], None], Callable[[str, list], bytes]] | None = None


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


class DirectCall(CallHead):
    """One request to a direct route, in place of uvicorn's RequestResponseCycle: its head (for
    the route), its body as it arrives, and what uvicorn's protocol reads of a cycle at a hang-up
    or shutdown (response_complete, keep_alive)."""

    __slots__ = ("protocol", "path", "keep_alive", "expect_100", "parts", "size", "refusal", "complete",
                 "queued", "task", "response_complete", "disconnected")

    def __init__(self, protocol, path: str, headers: list[tuple[bytes, bytes]], scheme: str, keep_alive: bool,
                 expect_100: bool):
        self.headers, self.scheme = headers, scheme
        self.protocol, self.path, self.keep_alive, self.expect_100 = protocol, path, keep_alive, expect_100
        self.parts: list[bytes] = []
        self.size = 0
        self.refusal: tuple[Exception, Headers] | None = None  # why it is answered without its body
        self.complete = False  # the body is whole
        self.queued = False  # behind a pipelined request still being answered
        self.task: asyncio.Task | None = None  # the route's, once started
        self.response_complete = self.disconnected = False

    def body(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    def _head(self, status: int, headers: Headers, framing: bytes) -> list[bytes]:
        """Status line, uvicorn's default headers (date, server), the route's, `framing`
        (content-length or chunked), and connection: close when not kept alive."""
        if headers is not JSON_HEADERS and (b"connection", b"close") in headers:
            self.keep_alive = False  # a refusal before the body was read (the guard's): the rest is not wanted
        content = [STATUS_LINE[status]]
        for name, value in (*self.protocol.server_state.default_headers, *headers):
            if name not in (b"content-length", b"connection"):
                content += (name, b": ", value, b"\r\n")
        content.append(framing)
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        return content

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """The answer in one write; the connection closes after it unless kept alive."""
        protocol = self.protocol
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()
        if self.disconnected:
            return
        content = self._head(status, headers, b"content-length: %d\r\n" % len(body))
        content.append(body)
        protocol.transport.write(b"".join(content))
        self._completed()

    async def stream(self, status: int, answer: EventStream) -> None:
        """The events as they come, chunked (the head goes with the first), after waiting for
        the client's window when it is full, so a reader that is behind finds the tokens it has
        not read joined into the next event (GenerationStream). What one callback makes leaves
        in one write (StreamWrites): the closing chunk, [DONE] and the body's end together. With
        `answer.push`, token events are written as they arrive while the window is open, with
        no wake of this task. An error the events did not catch closes the connection without
        the last chunk, so the client sees the answer cut short, as uvicorn did."""
        protocol = self.protocol
        flow = protocol.flow
        pending = b"".join(self._head(status, SSE_HEADERS, b"transfer-encoding: chunked\r\n"))
        writes = StreamWrites(self)
        try:
            async for event in answer.events:
                if flow.write_paused:
                    await flow.drain()
                if self.disconnected:
                    return
                writes.add(b"%s%x\r\n%s\r\n" % (pending, len(event), event))
                if pending and answer.push is not None:  # the head is on its way: tokens may go straight
                    writes.push_from(answer.push)
                pending = b""
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception:
            log.exception("a stream of %s failed after its first event", self.path)
            writes.write()  # the events before the failure
            self.response_complete = True
            protocol.transport.close()
            return
        finally:
            writes.stop()
            await answer.events.aclose()
        if not self.disconnected:
            writes.add(pending + b"0\r\n\r\n")
            writes.write()  # now: the connection may close or serve the next request
            self._completed()

    def _completed(self) -> None:
        self.response_complete = True
        protocol = self.protocol
        if not self.keep_alive:
            protocol.transport.close()
        protocol.on_response_complete()


class StreamWrites:
    """A stream's writes, each made once the callback that asked for it ends (call_soon), so
    what one callback makes leaves in one write: the events a task's step yields together, or
    the tokens of several steps read in one go, joined into one event.

    Tokens come straight from the engine client's dispatch (`take`, EventStream.push) while the
    client's window is open and the stream's task has nothing in hand (GenerationStream.follow):
    no wake of the task, no iterators between it and the generation, no chunk built: a fifth to
    a third less user CPU a token to 64 streams (docs/benchmarks.md). Tokens it cannot take queue
    for the task, which waits for the window."""

    __slots__ = ("call", "parts", "texts", "tokens", "follow", "encode", "due")

    def __init__(self, call: DirectCall):
        self.call = call
        self.parts: list[bytes] = []  # the body's bytes not written yet
        self.texts: list[str] = []  # tokens taken, not encoded yet (after `parts`)
        self.tokens: list = []
        self.follow: Callable | None = None
        self.encode: Callable[[str, list], bytes] | None = None
        self.due = False  # a write is scheduled

    def add(self, data: bytes) -> None:
        """The task's bytes of the body."""
        if self.texts:
            self._encode_taken()
        self.parts.append(data)
        self._schedule()

    def push_from(self, push: tuple[Callable, Callable[[str, list], bytes]]) -> None:
        self.follow, self.encode = push
        self.follow(self.take)

    def take(self, text: str, tokens: list) -> bool:
        call = self.call
        if call.protocol.flow.write_paused or call.disconnected:
            return False
        self.texts.append(text)
        self.tokens += tokens
        self._schedule()
        return True

    def _schedule(self) -> None:
        if not self.due:
            self.due = True
            asyncio.get_running_loop().call_soon(self._write_due)

    def _write_due(self) -> None:
        self.due = False
        self.write()

    def _encode_taken(self) -> None:
        texts, tokens = self.texts, self.tokens
        self.texts, self.tokens = [], []
        event = self.encode(texts[0] if len(texts) == 1 else "".join(texts), tokens)
        self.parts.append(b"%x\r\n%s\r\n" % (len(event), event))

    def write(self) -> None:
        """What waits, in one write, now."""
        call = self.call
        try:
            if self.texts:
                self._encode_taken()
            parts, self.parts = self.parts, []
            if parts and not call.disconnected:
                call.protocol.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
        except Exception:  # as the task's stream would: logged, the answer cut short
            log.exception("a stream of %s failed at a token's event", call.path)
            call.response_complete = True
            call.protocol.transport.close()

    def stop(self) -> None:
        if self.follow is not None:
            self.follow(None)


@dataclass(frozen=True)
class DirectRoute:
    body_type: Any  # the pydantic model of the body
    handler: Callable[[CallHead, Any], Awaitable[bytes | EventStream]]  # the answer's JSON, or its events


class DirectRoutes:
    def __init__(self, routes: dict[str, DirectRoute], guard: HttpGuard, errors: HttpErrors,
                 accepted: Callable[[str], Any]):
        """`accepted(name)`: the service's context held while a call is served (the drain waits for it)."""
        self.routes = routes
        self.raw_paths = frozenset(path.encode("ascii") for path in routes)  # as a request line carries them
        self.guard, self.errors, self.accepted = guard, errors, accepted

    def refusal(self, call: DirectCall) -> tuple[Exception, Headers] | None:
        """The guard's checks on the head (key, declared size), before the body is read."""
        return self.guard.refusal(call.path, call.headers)

    def too_large(self, call: DirectCall) -> None:
        """The body grew past the limit as it came (chunked): refused, what came of it dropped."""
        call.refusal, call.parts = (self.guard.too_large(), []), []

    async def serve(self, call: DirectCall) -> None:
        """Answer the call; nothing when the client hung up."""
        with self.accepted(f"POST {call.path}"):  # until the answer is written
            try:
                status, headers, body = await self.answer(call)
                if type(body) is EventStream:
                    return await call.stream(status, body)
            except asyncio.CancelledError:
                if not call.disconnected:
                    raise  # a shutdown's cancel: uvicorn's to handle
                asyncio.current_task().uncancel()
                return  # Nobody to answer; the service counted it.
            await call.respond(status, headers, body)

    async def answer(self, call: DirectCall) -> tuple[int, Headers, bytes | EventStream]:
        route = self.routes[call.path]
        extra: Headers = []
        try:
            if call.refusal is not None:
                error, extra = call.refusal
                raise error
            body = parse_body(call.body(), call.header(b"content-type"), route.body_type)
            return 200, JSON_HEADERS, await route.handler(call, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every refusal and failure, rendered and counted one way
            status, headers, body = self.errors.render(call.path, as_serve_error(exc, call.path))
            return status, headers + extra, body
