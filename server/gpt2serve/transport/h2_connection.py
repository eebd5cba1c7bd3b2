"""HTTP/2 (RFC 9113) server connections for the built-in gRPC server: frames, streams, flow control.

What a gRPC server needs of HTTP/2 and no more: no push, no priorities, no HTTP/1.1 upgrade. The
gRPC layer (`grpc_calls`) sees streams: `Http2App.stream_opened(stream, headers)` sets a
`StreamListener` for the request's data, end and reset, and answers through `Stream.send_*`.

- Out: frames wait in one buffer written once per event-loop turn (one system call for a turn's answers).
- Flow control: the peer's windows come back as calls take its data (`release`); answers wait in
  their stream for ours (`Stream.writable()` for a streaming call's back-pressure).
- gRPC's own server's policies (`ConnectionPolicy`): a handshake deadline, a ping flood sent GOAWAY,
  idle and aged connections closed gracefully, streams past the limit refused (clients retry them).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from .h2_frames import (
    ACK, COMPRESSION_ERROR, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, END_HEADERS,
    END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_HEAD, FRAME_SIZE_ERROR, GOAWAY, HEADERS, MAX_HEADER_LIST,
    MAX_WINDOW, NO_ERROR, PING, PREFACE, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM,
    RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE, STREAM_WINDOW, WINDOW_UPDATE, ConnectionPolicy, Http2App, Http2Error, Stream,
    read_settings, unpad,
)
from .hpack_codec import TABLE_SIZE_ZERO, HeaderDecoder, HpackError

log = logging.getLogger(__name__)


class Http2Connection(asyncio.Protocol):
    """One client connection. `app` opens streams; `server` counts connections and sets policy."""

    def __init__(self, app: Http2App, policy: ConnectionPolicy, on_closed=None):
        self.app, self.policy, self.on_closed = app, policy, on_closed
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = self.settings_seen = self.going_away = self.paused = self.lost = False
        self.streams: dict[int, Stream] = {}
        self.blocked: set[Stream] = set()
        self.last_stream_id = 0
        self.decoder = HeaderDecoder(max_list_size=MAX_HEADER_LIST)
        self.headers_pending: tuple[int, int, bytearray] | None = None  # (stream id, flags, block) until END_HEADERS
        self.send_window = DEFAULT_WINDOW
        self.peer_stream_window = DEFAULT_WINDOW
        self.peer_frame_size = DEFAULT_FRAME_SIZE
        self.unacked = 0
        self.recv_window = policy.connection_window  # what the peer may still send: more is an error
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.first_block_sent = False
        self.last_ping, self.ping_strikes = 0.0, 0
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.peer = "unknown"

    # The transport ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            self.peer = f"{'ipv6:[' + address[0] + ']' if ':' in address[0] else 'ipv4:' + address[0]}:{address[1]}"
        settings = b"".join(struct.pack(">HI", key, value) for key, value in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, self.policy.max_concurrent_streams),
            (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.send_frame(SETTINGS, 0, 0, settings)
        self.send_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.policy.connection_window - DEFAULT_WINDOW))
        self.timers["handshake"] = self.loop.call_later(self.policy.handshake_timeout_s, self.close)
        if self.policy.max_age_s > 0:
            self.timers["age"] = self.loop.call_later(self.policy.max_age_s, self.go_away)
        self.idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for timer in self.timers.values():
            timer.cancel()
        for stream in list(self.streams.values()):
            self.reset_by_peer(stream)
        if self.on_closed is not None:
            self.on_closed(self)

    def pause_writing(self) -> None:
        # A peer that does not read is not read: the acks and refusals it asks for are not flow-controlled.
        self.paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self.transport.resume_reading()
        for stream in list(self.streams.values()):
            stream.wake()

    def reset_by_peer(self, stream: Stream) -> None:
        self.stream_done(stream)
        if stream.listener is not None:
            stream.listener.reset_received()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.flush()
            self.transport.close()

    # Out ----------------------------------------------------------------------------------------

    def send_frame(self, ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        if ftype <= HEADERS:  # DATA or HEADERS: an answer, which clears a ping flood's strikes (as gRPC's)
            self.ping_strikes = 0
            if ftype == HEADERS and not self.first_block_sent:
                payload, self.first_block_sent = TABLE_SIZE_ZERO + payload, True
        self.out.append(FRAME_HEAD.pack(len(payload) << 8 | ftype, flags, stream_id))
        self.out.append(payload)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def send_now(self, stream: Stream, payload: bytes, end_stream: bool) -> bool:
        """Sends `payload` as DATA if both windows allow all of it."""
        if len(payload) > self.send_window or len(payload) > stream.send_window:
            return False
        self.data_frames(stream, payload, end_stream)
        return True

    def data_frames(self, stream: Stream, data: bytes, end_stream: bool) -> None:
        """`data` as DATA frames of at most the peer's frame size, taken from both windows
        (the caller checked them); END_STREAM on the last when `end_stream`."""
        self.send_window -= len(data)
        stream.send_window -= len(data)
        limit = self.peer_frame_size
        for start in range(0, max(len(data), 1), limit):
            last = start + limit >= len(data)
            self.send_frame(DATA, END_STREAM if end_stream and last else 0, stream.id, data[start:start + limit])
        if end_stream:
            self.stream_done(stream)

    def headers_frame(self, stream: Stream, block: bytes, end_stream: bool) -> None:
        self.send_frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream.id, block)
        if end_stream:
            self.stream_done(stream)

    def send_blocked(self) -> None:
        """Sends what the windows now allow of what waited, each stream in order."""
        for stream in list(self.blocked):
            while stream.pending and not stream.closed:
                ftype, payload, end_stream = stream.pending[0]
                if ftype == HEADERS:
                    stream.pending.pop(0)
                    self.headers_frame(stream, payload, end_stream)
                    continue
                room = min(self.send_window, stream.send_window)
                if room <= 0 and payload:
                    break
                part, rest = payload[:room], payload[room:]
                if rest:
                    stream.pending[0] = (DATA, rest, end_stream)
                else:
                    stream.pending.pop(0)
                self.data_frames(stream, part, end_stream and not rest)
                if rest:
                    break
            if not stream.pending or stream.closed:
                self.blocked.discard(stream)
                stream.wake()

    def stream_done(self, stream: Stream) -> None:
        stream.closed = True
        stream.pending.clear()
        self.blocked.discard(stream)
        stream.wake()
        if self.streams.pop(stream.id, None) is not None and not self.streams:
            self.idle()
            if self.going_away:
                self.loop.call_soon(self.close)

    def go_away(self, code: int = NO_ERROR, reason: bytes = b"") -> None:
        """No new streams; those under way finish (within the age grace), then the connection closes."""
        if self.going_away or self.transport is None:
            return
        self.going_away = True
        self.send_frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + reason)
        if not self.streams or code != NO_ERROR:
            self.loop.call_soon(self.close)
        else:
            self.timers["grace"] = self.loop.call_later(self.policy.age_grace_s, self.close)

    def idle(self) -> None:
        if self.policy.idle_timeout_s > 0 and not self.lost:
            self.cancel_timer("idle")
            self.timers["idle"] = self.loop.call_later(self.policy.idle_timeout_s, self.go_away_if_idle)

    def cancel_timer(self, name: str) -> None:
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def go_away_if_idle(self) -> None:
        if not self.streams:
            self.go_away()

    # In -----------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        try:
            if not self.preface_seen:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buffer)):
                        raise Http2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buffer[:len(PREFACE)] != PREFACE:
                    raise Http2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.preface_seen = True
                del buffer[:len(PREFACE)]
            pos, size = 0, len(buffer)
            while size - pos >= 9:
                head, flags, stream_id = FRAME_HEAD.unpack_from(buffer, pos)
                length = head >> 8
                if length > DEFAULT_FRAME_SIZE:
                    raise Http2Error(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if size - pos - 9 < length:
                    break
                payload = bytes(buffer[pos + 9:pos + 9 + length])
                pos += 9 + length
                self.frame_received(head & 0xFF, flags, stream_id & 0x7FFFFFFF, payload)
            del buffer[:pos]
        except Http2Error as exc:
            log.debug("HTTP/2 connection error: %s", exc)
            self.buffer.clear()
            self.go_away(exc.code, str(exc).encode()[:200])
            self.close()
        if self.blocked:
            self.send_blocked()

    def frame_received(self, ftype: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.headers_pending is not None and ftype != CONTINUATION:
            raise Http2Error(PROTOCOL_ERROR, "a frame between HEADERS and its CONTINUATION")
        if not self.settings_seen and ftype != SETTINGS:
            raise Http2Error(PROTOCOL_ERROR, "the preface's SETTINGS must come first")
        if ftype == DATA:
            self.data_frame(flags, stream_id, payload)
        elif ftype == HEADERS:
            if not stream_id:
                raise Http2Error(PROTOCOL_ERROR, "HEADERS on stream 0")
            payload = unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self.headers_complete(stream_id, flags, payload)
            else:
                self.headers_pending = (stream_id, flags, bytearray(payload))
        elif ftype == CONTINUATION:
            if self.headers_pending is None or self.headers_pending[0] != stream_id:
                raise Http2Error(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            block = self.headers_pending[2]
            block += payload
            if len(block) > MAX_HEADER_LIST:
                raise Http2Error(ENHANCE_YOUR_CALM, "header block too large")
            if flags & END_HEADERS:
                opened_flags = self.headers_pending[1]
                self.headers_pending = None
                self.headers_complete(stream_id, opened_flags, bytes(block))
        elif ftype == RST_STREAM:
            if (stream := self.streams.get(stream_id)) is not None:
                self.reset_by_peer(stream)
        elif ftype == SETTINGS:
            self.settings_frame(flags, stream_id, payload)
        elif ftype == PING:
            if stream_id:
                raise Http2Error(PROTOCOL_ERROR, "PING on a stream")
            self.ping_frame(flags, payload)
        elif ftype == GOAWAY:
            self.going_away = True
            if not self.streams:
                self.close()
        elif ftype == WINDOW_UPDATE:
            self.window_update(stream_id, payload)
        elif ftype == PUSH_PROMISE:
            raise Http2Error(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5).

    def data_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.recv_window -= len(payload)
        if self.recv_window < 0:  # a peer past the window would make us hold what it sends without bound
            raise Http2Error(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self.last_stream_id or not stream_id:
                raise Http2Error(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self.release(len(payload))
            return  # A stream we closed or reset: its data is counted and dropped.
        data = unpad(flags, payload)
        self.release(len(payload) - len(data))  # the padding
        if flags & END_STREAM:
            stream.remote_closed = True
        else:
            stream.unacked += len(payload)
            if stream.unacked >= STREAM_WINDOW // 2:
                self.send_frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.unacked))
                stream.unacked = 0
        if data:
            stream.listener.data_received(data)  # It releases the bytes as it takes them.
        if flags & END_STREAM and not stream.closed:
            stream.listener.end_received()

    def release(self, size: int) -> None:
        """`size` bytes of DATA are off our hands: the connection's window gets them back. Only what a
        call has taken counts, so a client's partial messages hold at most one window of memory."""
        self.unacked += size
        if self.unacked >= self.policy.connection_window // 2:
            self.send_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked))
            self.recv_window, self.unacked = self.recv_window + self.unacked, 0

    def headers_complete(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)  # Always: the table must follow every block.
        except HpackError as exc:
            raise Http2Error(COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: only an end is expected
            if not flags & END_STREAM:
                raise Http2Error(PROTOCOL_ERROR, "trailers without END_STREAM")
            stream.remote_closed = True
            stream.listener.end_received()
            return
        if stream_id % 2 == 0:
            raise Http2Error(PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        if stream_id <= self.last_stream_id:
            return  # trailers of a stream we already closed
        self.last_stream_id = stream_id
        if self.going_away or len(self.streams) >= self.policy.max_concurrent_streams:
            self.send_frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM))
            return
        stream = Stream(stream_id, self, self.peer_stream_window)
        self.streams[stream_id] = stream
        self.cancel_timer("idle")
        self.app.stream_opened(stream, headers)
        if stream.listener is None:
            raise RuntimeError("the app left a stream without a listener")
        if flags & END_STREAM and not stream.closed:
            stream.remote_closed = True
            stream.listener.end_received()

    def settings_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise Http2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        settings = read_settings(payload)
        if (window := settings.get(SETTINGS_INITIAL_WINDOW_SIZE)) is not None:
            delta, self.peer_stream_window = window - self.peer_stream_window, window
            for stream in self.streams.values():
                stream.send_window += delta
        self.peer_frame_size = settings.get(SETTINGS_MAX_FRAME_SIZE, self.peer_frame_size)
        self.send_frame(SETTINGS, ACK, 0)
        if not self.settings_seen:
            self.settings_seen = True
            self.cancel_timer("handshake")

    def ping_frame(self, flags: int, payload: bytes) -> None:
        if len(payload) != 8:
            raise Http2Error(FRAME_SIZE_ERROR, "PING of a bad length")
        if flags & ACK:
            return
        now = time.monotonic()
        # As gRPC's server: pings closer together than the interval are strikes; answers sent clear them.
        if self.last_ping and now - self.last_ping < self.policy.min_ping_interval_s:
            self.ping_strikes += 1
            if self.ping_strikes > self.policy.max_ping_strikes:
                self.go_away(ENHANCE_YOUR_CALM, b"too_many_pings")
                return
        self.last_ping = now
        self.send_frame(PING, ACK, 0, payload)

    def window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise Http2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE of a bad length")
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise Http2Error(PROTOCOL_ERROR, "a window update of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise Http2Error(FLOW_CONTROL_ERROR, "connection window past 2^31-1")
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
        if self.blocked:
            self.send_blocked()
