"""HTTP/2 for the built-in gRPC server: a connection's policy, the limits it holds a client to, and
its streams as the gRPC layer sees them. Frames, HPACK, flow control and stream states are
libnghttp2's (through `ngh2`); the connection that drives it is `h2_connection.Http2Connection`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from ngh2 import ErrorCode

Header = tuple[bytes, bytes]

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR = ErrorCode.NO_ERROR, ErrorCode.PROTOCOL_ERROR, ErrorCode.INTERNAL_ERROR
FLOW_CONTROL_ERROR, REFUSED_STREAM, CANCEL = ErrorCode.FLOW_CONTROL_ERROR, ErrorCode.REFUSED_STREAM, ErrorCode.CANCEL
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = ErrorCode.COMPRESSION_ERROR, ErrorCode.ENHANCE_YOUR_CALM
MAX_WINDOW = 2**31 - 1
# Windows we give the peer: a stream may send 4 MiB before we read it, a connection 16 MiB.
STREAM_WINDOW, CONNECTION_WINDOW = 4 << 20, 16 << 20
# A request's decoded header list, advertised as SETTINGS_MAX_HEADER_LIST_SIZE: gRPC's C-core
# refuses metadata past 16 KiB too (GRPC_ARG_ABSOLUTE_MAX_METADATA_SIZE).
MAX_HEADER_LIST = 16 << 10
# Decoded headers all of a connection's open calls may hold; a stream past it is refused.
HEADER_BUDGET = 1 << 20


@dataclass(frozen=True)
class ConnectionPolicy:
    max_concurrent_streams: int = 256
    handshake_timeout_s: float = 10.0
    min_ping_interval_s: float = 10.0
    max_ping_strikes: int = 2
    idle_timeout_s: float = 0.0  # 0: never
    max_age_s: float = 0.0  # 0: never
    age_grace_s: float = 10.0
    # How long an answer may wait for a peer that gives it no window before its stream is reset.
    send_timeout_s: float = 30.0
    # DATA a connection may have in flight and in calls' partial messages: at least two of the largest message.
    connection_window: int = CONNECTION_WINDOW
    # What one connection may feed the codec in one event-loop turn; the rest waits a turn, so
    # a connection sending as fast as it can gets its share of the loop and no more.
    bytes_per_turn: int = 64 << 10
    # Frames that cost us work and bring none (updates to windows with nothing waiting, empty
    # DATA, a running call reset): a token bucket (burst, per second), past it GOAWAY
    # ENHANCE_YOUR_CALM. libnghttp2 keeps its own limits below ours; this one is for what it
    # takes as valid. Each call answered puts `wasted_frames_per_call` back: a client reading its
    # answers sends a window update or two for each, so only frames without calls can run it dry.
    wasted_frames: tuple[int, float] = (1000, 200.0)
    wasted_frames_per_call: int = 4


class StreamListener(Protocol):
    def data_received(self, data: bytes) -> None: ...
    def end_received(self) -> None: ...
    def reset_received(self) -> None: ...


class Http2App(Protocol):
    def stream_opened(self, stream: Stream, headers: tuple[Header, ...]) -> None: ...


class Connection(Protocol):
    """What a stream asks of its connection (h2_connection.Http2Connection)."""

    paused: bool
    peer: str  # the client's address, as grpc.aio's ServicerContext.peer() gives it

    def send_headers(self, stream: Stream, headers: list[Header], end_stream: bool) -> None: ...
    def send_data(self, stream: Stream, payload: bytes, end_stream: bool) -> None: ...
    def send_answer(self, stream: Stream, headers: list[Header], payload: bytes, trailers: list[Header]) -> None: ...
    def over_window(self, stream: Stream) -> bool: ...
    def reset(self, stream: Stream, code: int) -> None: ...
    def release(self, stream: Stream, size: int) -> None: ...
    def widen(self, stream: Stream, window: int) -> None: ...
    def stop_peer(self, stream: Stream) -> None: ...
    def wait_writable(self, stream: Stream) -> None: ...


class Stream:
    """One request and its answer. `send_headers`/`send_data` queue to the codec, which sends what
    the peer's windows allow as the connection writes; the rest waits there, in order, with any
    trailers behind it."""

    __slots__ = ("id", "connection", "listener", "header_bytes", "response_sent", "remote_closed", "closed",
                 "stalled_since", "stalled_queue", "window", "_waiter")

    def __init__(self, stream_id: int, connection: Connection, header_bytes: int = 0):
        self.id, self.connection, self.header_bytes = stream_id, connection, header_bytes
        self.listener: StreamListener | None = None
        self.response_sent = self.remote_closed = self.closed = False
        self.window = STREAM_WINDOW  # the window we give the peer on this stream
        self.stalled_since: float | None = None  # since when its answer has waited for the peer's window
        self.stalled_queue = 0  # what was queued then: less since is progress
        self._waiter: asyncio.Future | None = None

    def send_headers(self, headers: list[Header], end_stream: bool = False) -> None:
        """The answer's headers, or (after them) its trailers, which end the stream."""
        if not self.closed:
            self.connection.send_headers(self, headers, end_stream)

    def send_data(self, payload: bytes, end_stream: bool = False) -> None:
        if not self.closed:
            self.connection.send_data(self, payload, end_stream)

    def send_answer(self, headers: list[Header], payload: bytes, trailers: list[Header]) -> None:
        """A whole answer at once (a unary call's): headers, the payload as DATA, trailers."""
        if not self.closed:
            self.connection.send_answer(self, headers, payload, trailers)

    def release(self, size: int) -> None:
        """The listener has taken `size` bytes of this stream's data: the peer's windows get them back."""
        self.connection.release(self, size)

    def expect(self, size: int) -> None:
        """A message of `size` bytes is coming, held until whole: the stream's window takes all of
        it (the connection's window still bounds what the connection holds)."""
        if size > self.window:
            self.window = size
            self.connection.widen(self, size)

    def reset(self, code: int = CANCEL) -> None:
        """Ends the stream from our side (RST_STREAM); nothing more is sent or read."""
        if not self.closed:
            self.connection.reset(self, code)

    def stop_peer(self) -> None:
        """After our END_STREAM, tells a peer still sending to stop (RST_STREAM NO_ERROR, RFC 9113
        8.1), once the answer has left: a reset sent earlier would drop what still waits for window."""
        if not self.remote_closed:
            self.connection.stop_peer(self)

    @property
    def blocked(self) -> bool:
        """More is queued than the peer's windows let out, or the socket's buffer is full."""
        return self.connection.paused or self.connection.over_window(self)

    async def writable(self) -> None:
        """Until what was sent has left for the peer's window and the socket's buffer."""
        while self.blocked and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            self.connection.wait_writable(self)
            try:
                await self._waiter
            finally:
                self._waiter = None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
