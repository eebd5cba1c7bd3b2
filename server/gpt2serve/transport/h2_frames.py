"""HTTP/2 (RFC 9113) for the built-in gRPC server: frame layout, codes, a connection's policy and
its streams. The connection that reads and writes the frames is `h2_connection.Http2Connection`.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Protocol

from .hpack_codec import Header

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 1, 3, 4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 5, 6
DEFAULT_WINDOW, DEFAULT_FRAME_SIZE, MAX_WINDOW = 65535, 16384, 2**31 - 1
# Windows we give the peer: a stream may send 4 MiB before we read it, a connection 16 MiB.
STREAM_WINDOW, CONNECTION_WINDOW = 4 << 20, 16 << 20
MAX_HEADER_LIST = 64 << 10


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return FRAME_HEAD.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


class Http2Error(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with `code`, then close."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS frame's payload without its padding."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise Http2Error(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


@dataclass(frozen=True)
class ConnectionPolicy:
    max_concurrent_streams: int = 256
    handshake_timeout_s: float = 10.0
    min_ping_interval_s: float = 10.0
    max_ping_strikes: int = 2
    idle_timeout_s: float = 0.0  # 0: never
    max_age_s: float = 0.0  # 0: never
    age_grace_s: float = 10.0
    # DATA a connection may have in flight and in calls' partial messages: at least two of the largest message.
    connection_window: int = CONNECTION_WINDOW


def read_settings(payload: bytes) -> dict[int, int]:
    """A SETTINGS frame's values by key (the last of a repeated one), those we act on checked."""
    if len(payload) % 6:
        raise Http2Error(FRAME_SIZE_ERROR, "SETTINGS of a bad length")
    settings = dict(struct.iter_unpack(">HI", payload))
    if settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 0) > MAX_WINDOW:
        raise Http2Error(FLOW_CONTROL_ERROR, "initial window too large")
    if not DEFAULT_FRAME_SIZE <= settings.get(SETTINGS_MAX_FRAME_SIZE, DEFAULT_FRAME_SIZE) <= 2**24 - 1:
        raise Http2Error(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
    return settings


class StreamListener(Protocol):
    def data_received(self, data: bytes) -> None: ...
    def end_received(self) -> None: ...
    def reset_received(self) -> None: ...


class Http2App(Protocol):
    def stream_opened(self, stream: Stream, headers: list[Header]) -> None: ...


class Connection(Protocol):
    """What a stream asks of its connection (h2_connection.Http2Connection)."""

    blocked: set[Stream]
    paused: bool
    peer: str  # the client's address, as grpc.aio's ServicerContext.peer() gives it

    def send_frame(self, ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> None: ...
    def send_now(self, stream: Stream, payload: bytes, end_stream: bool) -> bool: ...
    def headers_frame(self, stream: Stream, block: bytes, end_stream: bool) -> None: ...
    def send_blocked(self) -> None: ...
    def stream_done(self, stream: Stream) -> None: ...
    def release(self, size: int) -> None: ...


class Stream:
    """One request and its answer. `send_headers`/`send_data` queue frames; data the peer has no
    window for waits here, in order, with any trailers behind it."""

    __slots__ = ("id", "connection", "listener", "send_window", "pending", "remote_closed", "closed",
                 "unacked", "_waiter")

    def __init__(self, stream_id: int, connection: Connection, send_window: int):
        self.id, self.connection, self.send_window = stream_id, connection, send_window
        self.listener: StreamListener | None = None
        self.pending: list[tuple[int, bytes, bool]] = []  # (frame type, payload, end_stream) held back
        self.remote_closed = self.closed = False
        self.unacked = 0  # bytes read that the peer's window has not been given back
        self._waiter: asyncio.Future | None = None

    def send_headers(self, block: bytes, end_stream: bool = False) -> None:
        if self.closed:
            return
        if self.pending:
            self.pending.append((HEADERS, block, end_stream))
            return
        self.connection.headers_frame(self, block, end_stream)

    def send_data(self, payload: bytes, end_stream: bool = False) -> None:
        if self.closed:
            return
        if self.pending or not self.connection.send_now(self, payload, end_stream):
            self.pending.append((DATA, payload, end_stream))
            self.connection.blocked.add(self)
            self.connection.send_blocked()  # what the windows allow of it now

    def release(self, size: int) -> None:
        """The listener has taken `size` bytes of this stream's data (h2_connection.release)."""
        self.connection.release(size)

    def reset(self, code: int = CANCEL) -> None:
        """Ends the stream from our side (RST_STREAM); nothing more is sent or read."""
        if not self.closed:
            self.connection.send_frame(RST_STREAM, 0, self.id, struct.pack(">I", code))
            self.connection.stream_done(self)

    def stop_peer(self) -> None:
        """After our END_STREAM, tells a peer still sending to stop (RST_STREAM NO_ERROR, RFC 9113
        8.1). While the answer still waits for window, nothing is sent: it is left to go out, and
        what the peer sends meanwhile is dropped as it comes (the finished call releases it)."""
        if self.closed and not self.remote_closed:
            self.remote_closed = True
            self.connection.send_frame(RST_STREAM, 0, self.id, struct.pack(">I", NO_ERROR))

    @property
    def blocked(self) -> bool:
        return bool(self.pending) or self.connection.paused

    async def writable(self) -> None:
        """Until what was sent has left for the peer's window and the socket's buffer."""
        while self.blocked and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
