"""gRPC calls over the built-in HTTP/2 server: length-prefixed messages, statuses in trailers,
deadlines, and the `grpc.aio.ServicerContext` methods the servicers use.

A call's life: its headers open it (`GrpcApp.stream_opened`: the method, the deadline, the
metadata); its messages come in (`Call.data_received`); a unary or server-streaming call runs
its handler once the request is whole, a bidirectional one at once over an async iterator of
requests. The answer goes out as headers, messages and trailers (for a unary call, one write
with the connection's other answers of that turn); an error before any message is a
trailers-only answer. A client's RST_STREAM, a lost connection or the deadline cancels the
handler's task. A request that has not arrived whole within the app's request timeout is
cancelled (one sweep an app), so stalled calls cannot hold their connections open.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from .grpc_context import CallContext
from .h2_stream import Header, Stream

log = logging.getLogger(__name__)

MESSAGE_HEAD = struct.Struct(">BI")  # compressed flag, length
MAX_WAITING_MESSAGES = 64  # a bidirectional call's requests its handler has not taken yet
UNARY, SERVER_STREAM, BIDI = "unary", "server_stream", "bidi"
ANSWER_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
OK_TRAILERS = [(b"grpc-status", b"0")]
# Compressed requests, by grpc-encoding: zlib's window bits for each (answers go uncompressed).
DECOMPRESSORS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# What grpc.aio leaves out of invocation_metadata(): the call's own HTTP/2 and gRPC headers.
TRANSPORT_HEADERS = frozenset({b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"})


@dataclass(frozen=True)
class GrpcMethod:
    kind: str  # UNARY, SERVER_STREAM or BIDI
    behaviour: Callable  # (request, context) -> answer, or an async iterator of answers
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


def status_headers(code: grpc.StatusCode, details: str | None, metadata=()) -> list[Header]:
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' as is, everything else %XX of its UTF-8.
        headers.append((b"grpc-message", urllib.parse.quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
                        .encode()))
    for key, value in metadata:
        headers.append((key.encode(), value if isinstance(value, bytes) else str(value).encode()))
    return headers


def message(payload: bytes) -> bytes:
    return MESSAGE_HEAD.pack(0, len(payload)) + payload


def serialize(answer) -> bytes:
    """A protobuf answer's bytes (GrpcMethod.serialize for every method that answers protobuf)."""
    return answer.SerializeToString()


class Call:
    """One gRPC call on one HTTP/2 stream (the stream's listener)."""

    def __init__(self, app: GrpcApp, stream: Stream, method: GrpcMethod, max_message: int, *,
                 metadata: tuple[tuple[str, str], ...] = (), deadline: float | None = None, peer: str = "",
                 encoding: bytes | None = None):
        self.app, self.stream, self.method, self.max_message = app, stream, method, max_message
        self.encoding = encoding
        self.context = CallContext(self, metadata, deadline, peer)
        self.buffer = bytearray()
        self.requests: list[bytes] = []
        self.task: asyncio.Task | None = None
        self.inbox: asyncio.Queue | None = None
        self.headers_sent = self.cancelled = self.finished = False
        self.deadline_timer = None if deadline is None else asyncio.get_running_loop().call_later(
            max(deadline - time.monotonic(), 0.0), self.expire)
        app.awaiting_request(self)
        if method.kind == BIDI:
            self.inbox = asyncio.Queue()
            self.start(self.run_bidi())

    # The stream's listener ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.finished:
            self.stream.release(len(data))
            return
        buffer = self.buffer
        buffer += data
        while len(buffer) >= 5:
            compressed, length = MESSAGE_HEAD.unpack_from(buffer)
            if length > self.max_message:
                self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Received message larger than max ({length} vs. {self.max_message})")
                return
            if len(buffer) < 5 + length:
                self.stream.expect(5 + length)  # a message larger than the stream's window still comes whole
                return
            # A refused message stays in the buffer, whose window done() gives back with the rest.
            payload = bytes(buffer[5:5 + length])
            if compressed and (payload := self.decompress(payload)) is None:
                return
            if self.inbox is not None:  # its window comes back when the handler takes it
                if self.inbox.qsize() >= MAX_WAITING_MESSAGES:
                    self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_WAITING_MESSAGES} request "
                                "messages waiting for the handler: read the answers before sending more")
                    return
                del buffer[:5 + length]
                self.inbox.put_nowait((payload, 5 + length))
                continue
            if self.requests:  # a second message for a one-request method: refused now, not held
                self.refuse(grpc.StatusCode.UNIMPLEMENTED, "expected one request message, got more")
                return
            del buffer[:5 + length]
            self.stream.release(5 + length)
            self.requests.append(payload)

    def decompress(self, payload: bytes) -> bytes | None:
        """A compressed message's bytes, at most the message limit; None when refused."""
        wbits = DECOMPRESSORS.get(self.encoding)
        if wbits is None:
            self.refuse(grpc.StatusCode.UNIMPLEMENTED,
                        f"a compressed message in grpc-encoding {self.encoding!r}; send identity, gzip or deflate")
            return None
        try:
            inflater = zlib.decompressobj(wbits)
            data = inflater.decompress(payload, self.max_message + 1)
        except zlib.error as exc:
            self.refuse(grpc.StatusCode.INTERNAL, f"a compressed message that does not decompress: {exc}")
            return None
        if len(data) > self.max_message:
            self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max (more than {self.max_message} bytes decompressed)")
            return None
        return data

    def end_received(self) -> None:
        self.app.waiting.pop(self, None)
        if self.finished:
            return
        if self.inbox is not None:
            self.inbox.put_nowait(None)
            return
        if not self.requests or self.buffer:
            self.refuse(grpc.StatusCode.INTERNAL, "expected one request message, got "
                        + ("a partial one" if self.buffer else "none"))
            return
        try:
            request = self.method.deserialize(self.requests[0])
        except Exception as exc:  # noqa: BLE001 - our own methods parse leniently; the others say why here
            self.refuse(grpc.StatusCode.INTERNAL, f"the request could not be parsed: {exc}")
            return
        self.start(self.run_unary(request) if self.method.kind == UNARY else self.run_server_stream(request))

    def reset_received(self) -> None:
        self.cancel()

    # Running ------------------------------------------------------------------------------------

    def start(self, coroutine) -> None:
        self.task = asyncio.get_running_loop().create_task(coroutine)
        self.app.calls.add(self)

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled = True
            self.done()
            if self.task is not None:
                self.task.cancel()

    def expire(self) -> None:
        if not self.finished:
            self.cancelled = True
            self.refuse(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # and cancels the task

    def done(self) -> None:
        self.finished = True
        if self.buffer:  # a partial message no one will take
            self.stream.release(len(self.buffer))
            self.buffer.clear()
        while self.inbox is not None and not self.inbox.empty():  # and whole ones
            if (taken := self.inbox.get_nowait()) is not None:
                self.stream.release(taken[1])
        self.app.calls.discard(self)
        self.app.waiting.pop(self, None)
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()

    async def run_unary(self, request) -> None:
        try:
            answer = await self.method.behaviour(request, self.context)
            if self.finished:
                return
            payload = message(self.method.serialize(answer))
        except BaseException as exc:  # noqa: BLE001 - every way out is a status
            self.failed(exc)
            return
        context = self.context
        self.stream.send_answer(ANSWER_HEADERS, payload, status_headers(grpc.StatusCode.OK, None, context.trailing)
                                if context.trailing else OK_TRAILERS)
        self.ended()

    async def run_server_stream(self, request) -> None:
        try:
            await self.send_all(self.method.behaviour(request, self.context))
        except BaseException as exc:  # noqa: BLE001
            self.failed(exc)

    async def run_bidi(self) -> None:
        async def requests():  # each message's window back as it is taken, so an unread inbox holds one window
            while (taken := await self.inbox.get()) is not None:
                self.stream.release(taken[1])
                yield self.method.deserialize(taken[0])

        try:
            await self.send_all(self.method.behaviour(requests(), self.context))
        except BaseException as exc:  # noqa: BLE001
            self.failed(exc)

    async def send_all(self, answers) -> None:
        """A streaming handler's answers: the messages it yields, or those it writes
        (`context.write`) until its coroutine returns; then the status."""
        if hasattr(answers, "__aiter__"):
            async for answer in answers:
                if self.finished:
                    return
                await self.send(answer)
        else:
            await answers
        if self.finished:
            return
        code = self.context.code or grpc.StatusCode.OK
        self.finish(code, self.context.details if code != grpc.StatusCode.OK else None)

    async def send(self, answer) -> None:
        """One message of a streaming answer (the headers first), then waits while the peer's
        window or the socket holds it back."""
        stream = self.stream
        if not self.headers_sent:
            stream.send_headers(ANSWER_HEADERS)
            self.headers_sent = True
        stream.send_data(message(self.method.serialize(answer)))
        if stream.blocked:
            await stream.writable()

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            if not self.finished:  # cancelled by the server's stop
                self.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        if self.finished:
            return
        if isinstance(exc, grpc.aio.AbortError):
            self.finish(self.context.code or grpc.StatusCode.UNKNOWN, self.context.details)
            return
        log.error("unhandled error in a gRPC call", exc_info=exc)
        self.finish(grpc.StatusCode.UNKNOWN, f"Unexpected error in the handler: {type(exc).__name__}")
        if not isinstance(exc, Exception):
            raise exc

    def finish(self, code: grpc.StatusCode, details: str | None) -> None:
        """Trailers (trailers-only when nothing was sent), and a reset if the client still sends."""
        trailers = status_headers(code, details, self.context.trailing)
        stream = self.stream
        stream.send_headers(trailers if self.headers_sent else ANSWER_HEADERS + trailers, end_stream=True)
        self.ended()

    def refuse(self, code: grpc.StatusCode, details: str) -> None:
        self.finish(code, details)
        if self.task is not None:
            self.task.cancel()

    def ended(self) -> None:
        self.stream.stop_peer()
        self.done()


def parse_timeout(value: bytes) -> float | None:
    try:
        return int(value[:-1]) * TIMEOUT_UNITS[value[-1:]]
    except (KeyError, ValueError):
        return None


class GrpcApp:
    """The methods, by path, that streams open. `guard(path, headers)` may put a method of its own
    in a call's place (one that refuses it, as an interceptor of grpc.aio would)."""

    def __init__(self, methods: dict[str, GrpcMethod], max_message: int,
                 guard: Callable[[str, tuple[Header, ...]], GrpcMethod | None] | None = None,
                 request_timeout_s: float = 30.0):
        self.methods = {path.encode(): method for path, method in methods.items()}
        self.max_message, self.guard, self.request_timeout_s = max_message, guard, request_timeout_s
        self.calls: set[Call] = set()
        self.waiting: dict[Call, float] = {}  # calls whose request is not whole yet: when they are cut, oldest first
        self.sweep_timer: asyncio.TimerHandle | None = None

    def awaiting_request(self, call: Call) -> None:
        self.waiting[call] = time.monotonic() + self.request_timeout_s
        if self.sweep_timer is None:
            self.schedule_sweep()

    def sweep(self) -> None:
        """Cancels the calls whose request is late; runs while any request is awaited."""
        self.sweep_timer, now = None, time.monotonic()
        for call, cut_at in list(self.waiting.items()):
            if cut_at > now:
                break  # one timeout for all: later calls are cut later
            call.refuse(grpc.StatusCode.CANCELLED, f"the request did not arrive whole within "
                                                   f"{self.request_timeout_s:g} s (--grpc-request-timeout-s)")
        if self.waiting:  # (a refused call has left it: Call.done)
            self.schedule_sweep()

    def schedule_sweep(self) -> None:
        self.sweep_timer = asyncio.get_running_loop().call_later(min(1.0, self.request_timeout_s / 10), self.sweep)

    def stream_opened(self, stream: Stream, headers: tuple[Header, ...]) -> None:
        path = content_type = timeout = encoding = None
        metadata = []
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = parse_timeout(value)
            elif name == b"grpc-encoding":
                encoding = value
            elif name not in TRANSPORT_HEADERS:
                metadata.append((name.decode("latin-1"), value.decode("latin-1")))
        peer = stream.connection.peer
        deadline = None if timeout is None else time.monotonic() + timeout
        method = self.methods.get(path)
        refusal = None
        if content_type is None or not content_type.startswith(b"application/grpc"):
            refusal = (grpc.StatusCode.UNKNOWN, f"content-type {content_type!r} is not application/grpc")
        elif method is None:
            refusal = (grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {(path or b'').decode('latin-1')}")
        elif self.guard is not None:
            method = self.guard(path.decode("latin-1"), headers) or method
        if refusal is not None:
            method = GrpcMethod(UNARY, None, bytes, bytes)
        call = Call(self, stream, method, self.max_message, metadata=tuple(metadata), deadline=deadline, peer=peer,
                    encoding=encoding)
        stream.listener = call
        if refusal is not None:
            call.refuse(*refusal)

    def cancel_all(self) -> None:
        for call in list(self.calls):
            if call.task is not None:
                call.task.cancel()
