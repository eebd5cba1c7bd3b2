"""HTTP/2 (RFC 9113) server connections for the built-in gRPC server, on libnghttp2 (`ngh2`).

libnghttp2 reads and writes the frames, keeps HPACK, flow control and the stream states, checks
every request as RFC 9113 section 8 asks (a malformed one is a stream error, never a call), and
holds its own flood limits (RST_STREAM and "glitch" rates, CONTINUATION count, queued acks,
header list size). What is ours is the asyncio side and gRPC's server policies:

- Out: the codec's bytes are written once per event-loop turn (one system call for a turn's answers).
- In: at most `bytes_per_turn` of a connection's input a turn, so one client sending as fast as
  it can gets its share of the loop, and frames that cost work and bring none (updates to windows
  with nothing waiting, empty DATA, running calls reset) are counted: past a token bucket, GOAWAY
  ENHANCE_YOUR_CALM.
- Flow control: the peer's windows come back as calls take its data (`release`), so a client's
  partial messages hold at most one window; an answer the peer gives no window for within
  `send_timeout_s` has its stream reset.
- gRPC's own server's policies: a handshake deadline, a ping flood sent GOAWAY, idle and aged
  connections closed gracefully, streams past the limit refused (clients retry them).
- Ending: a connection the codec or a policy ends gets GOAWAY with its code, then writes nothing
  more; what the peer still sends is read and dropped for a moment, so the peer reads the GOAWAY
  rather than a reset, then the socket closes. A fatal codec error is one log line, rate-limited.
"""

from __future__ import annotations

import asyncio
import logging

import ngh2
from ngh2 import (
    Configuration, DataReceived, GoAwayReceived, PingReceived, RequestReceived, Role, SettingsReceived,
    StreamClosed, StreamReset, TrailersReceived, WindowUpdated,
)

from .h2_events import PeerEvents
from .h2_limits import LINGER_BYTES, LINGER_S, RateLimitedLog, SlowPeers, TokenBucket, fatal_code, goaway_frame
from .h2_stream import (
    CANCEL, ENHANCE_YOUR_CALM, MAX_HEADER_LIST, MAX_WINDOW, NO_ERROR, STREAM_WINDOW, ConnectionPolicy, Header,
    Http2App, Stream,
)

log = logging.getLogger(__name__)
# Events that start, feed or end calls: after them, a flush goes behind the calls' first steps.
CALL_EVENTS = frozenset({RequestReceived, DataReceived, TrailersReceived, StreamReset, StreamClosed})
CODEC = Configuration(auto_window_update=False, max_inbound_header_list_size=MAX_HEADER_LIST)
ENDED_LOG = RateLimitedLog(log)


class Http2Connection(PeerEvents, SlowPeers, asyncio.Protocol):
    """One client connection. `app` opens streams; `server` counts connections and sets policy."""

    def __init__(self, app: Http2App, policy: ConnectionPolicy, on_closed=None):
        self.app, self.policy, self.on_closed = app, policy, on_closed
        self.loop = asyncio.get_running_loop()
        self.codec = ngh2.Connection(Role.SERVER, CODEC)
        self.transport: asyncio.Transport | None = None
        self.settings_seen = self.going_away = self.paused = self.lost = self.ended = self.feeding = False
        self.streams: dict[int, Stream] = {}
        self.header_bytes = 0  # decoded headers the open streams hold
        self.streams_opened = 0
        self.last_stream_id = 0
        self.backlog = b""  # input past this turn's share, fed next turn
        self.lingered = 0
        self.waiting: set[Stream] = set()  # streaming answers waiting for window or the socket
        self.stopping: set[Stream] = set()  # answered streams whose peer is to be told to stop sending
        self.wasted = TokenBucket(*policy.wasted_frames)
        self.flush_scheduled = False
        self.last_ping, self.ping_strikes = 0.0, 0
        self.idle_since = 0.0
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.peer = "unknown"
        self.handlers = {RequestReceived: self.request_received, DataReceived: self.data_frame,
                         TrailersReceived: self.trailers_received, StreamReset: self.stream_reset,
                         StreamClosed: self.stream_closed, WindowUpdated: self.window_updated,
                         SettingsReceived: self.settings_received, PingReceived: self.ping_received,
                         GoAwayReceived: self.goaway_received}

    # The transport ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            self.peer = f"{'ipv6:[' + address[0] + ']' if ':' in address[0] else 'ipv4:' + address[0]}:{address[1]}"
        self.codec.initiate_connection({
            ngh2.Setting.MAX_CONCURRENT_STREAMS: self.policy.max_concurrent_streams,
            ngh2.Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            ngh2.Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST})
        self.codec.set_local_window_size(self.policy.connection_window)
        self.timers["handshake"] = self.loop.call_later(self.policy.handshake_timeout_s, self.close)
        if self.policy.max_age_s > 0:
            self.timers["age"] = self.loop.call_later(self.policy.max_age_s, self.go_away)
        self.idle()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.ended = True
        for timer in self.timers.values():
            timer.cancel()
        for stream in list(self.streams.values()):
            self.stream_gone(stream)
        if self.on_closed is not None:
            self.on_closed(self)

    def pause_writing(self) -> None:
        # A peer that does not read is not read: the acks and refusals it asks for are not flow-controlled.
        self.paused = True
        self.set_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self.set_reading()
        self.schedule_flush()  # wakes the streams that waited on the socket

    def set_reading(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if (self.paused or self.backlog) and not self.ended:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.flush()
            self.transport.close()

    # In -----------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.ended:  # lingering after GOAWAY: dropped
            self.lingered += len(data)
            if self.lingered > LINGER_BYTES and self.transport is not None:
                self.transport.abort()
            return
        if self.backlog:
            self.backlog += data
            return
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """This turn's share of `data` to the codec, and its events handled; the rest waits a turn."""
        share = self.policy.bytes_per_turn
        chunk, self.backlog = (data, b"") if len(data) <= share else (data[:share], data[share:])
        try:
            self.codec.receive_data(chunk)
        except ngh2.NGH2Error as exc:
            self.codec_failed(exc)
            return
        self.feeding = True
        try:
            calls = self.handle_events()
        finally:
            self.feeding = False
        if self.backlog and not self.ended:
            self.loop.call_soon(self.feed_backlog)
            self.set_reading()
        # Scheduled now, behind the steps of the calls this input started, their answers go out this
        # turn; input that only updates windows or acks (a client's reply to answers) flushes nothing
        # unless the codec has something to send.
        codec = self.codec
        if calls or codec.want_write or not codec.want_read:
            self.schedule_flush()

    def feed_backlog(self) -> None:
        if self.backlog and not self.ended:
            data, self.backlog = self.backlog, b""
            self.feed(data)
            if not self.backlog:
                self.set_reading()  # caught up: read again

    def handle_events(self) -> bool:
        """Handles the codec's events; whether any started, fed or ended a call."""
        events = self.codec.events()
        if not events:
            return False
        handlers, calls = self.handlers, False
        reset_now = {e.stream_id for e in events if type(e) is StreamReset} if len(events) > 2 else ()
        for event in events:
            if self.ended:
                return calls
            calls = calls or type(event) in CALL_EVENTS
            if reset_now and type(event) is RequestReceived and event.stream_id in reset_now:
                self.last_stream_id = max(self.last_stream_id, event.stream_id)
                self.waste("a stream reset as it opened")  # Rapid Reset: no call is made for it
                continue
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)
        return calls

    def waste(self, what: str) -> None:
        if not self.wasted.take() and not self.going_away:
            ENDED_LOG.warning("gRPC connection from %s sent GOAWAY ENHANCE_YOUR_CALM: too many frames that "
                              "do no work (last: %s)", self.peer, what)
            self.go_away(ENHANCE_YOUR_CALM, b"too_many_wasted_frames")

    def codec_failed(self, exc: ngh2.NGH2Error) -> None:
        """The codec can no longer be used: GOAWAY by hand, with the code the error calls for."""
        code = fatal_code(exc)
        ENDED_LOG.warning("gRPC connection from %s ended with GOAWAY %s: %s", self.peer, code.name, exc)
        self.backlog = b""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(goaway_frame(self.last_stream_id, code, str(exc).encode()))
        self.end(str(exc))

    # Out ----------------------------------------------------------------------------------------

    def send_headers(self, stream: Stream, headers: list[Header], end_stream: bool) -> None:
        self.ping_strikes = 0  # an answer clears a ping flood's strikes, as gRPC's server does
        try:
            if not stream.response_sent:
                stream.response_sent = True
                self.codec.send_response(stream.id, headers, end_stream=end_stream)
            else:
                self.codec.send_trailers(stream.id, headers)
        except ngh2.NGH2Error:  # the stream closed under us (the peer reset it meanwhile)
            return
        self.schedule_flush()

    def send_data(self, stream: Stream, payload: bytes, end_stream: bool) -> None:
        self.ping_strikes = 0
        try:
            self.codec.send_data(stream.id, payload, end_stream=end_stream)
        except ngh2.NGH2Error:
            return
        self.schedule_flush()

    def send_answer(self, stream: Stream, headers: list[Header], payload: bytes, trailers: list[Header]) -> None:
        self.ping_strikes, stream.response_sent, codec = 0, True, self.codec
        try:  # one crossing of ours for the three (a unary answer's whole cost here is per call)
            codec.send_response(stream.id, headers)
            codec.send_data(stream.id, payload)
            codec.send_trailers(stream.id, trailers)
        except ngh2.NGH2Error:
            return
        self.schedule_flush()

    def reset(self, stream: Stream, code: int) -> None:
        try:
            self.codec.reset_stream(stream.id, code)
        except ngh2.NGH2Error:
            pass
        stream.closed = True
        self.schedule_flush()

    def release(self, stream: Stream, size: int) -> None:
        """`size` bytes of DATA are off our hands: the windows get them back. Only what a call has
        taken counts, so a client's partial messages hold at most one window of memory."""
        if self.ended:
            return
        try:
            self.codec.acknowledge_received_data(size, stream.id)
        except ngh2.NGH2Error:
            return
        # A WINDOW_UPDATE may be due (half a window taken; most releases owe none). Input being fed
        # is checked once at its end (feed), so only a release between reads asks the codec here.
        if not self.feeding and not self.flush_scheduled and self.codec.want_write:
            self.schedule_flush()

    def widen(self, stream: Stream, window: int) -> None:
        try:
            self.codec.set_local_window_size(min(window, MAX_WINDOW), stream_id=stream.id)
        except ngh2.NGH2Error:
            return
        self.schedule_flush()

    def stop_peer(self, stream: Stream) -> None:
        self.stopping.add(stream)
        self.schedule_flush()

    def wait_writable(self, stream: Stream) -> None:
        self.waiting.add(stream)
        self.schedule_flush()

    def schedule_flush(self) -> None:
        if not self.flush_scheduled and not self.ended:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Writes what the codec has for the peer, then what follows from it: streams it closed,
        peers told to stop sending, waiting answers woken, and the end once the codec has ended."""
        self.flush_scheduled = False
        if self.ended or self.transport is None or self.transport.is_closing():
            return
        codec = self.codec
        try:
            data = codec.data_to_send()
            if data:
                self.transport.write(data)
            self.handle_events()  # streams closed by what was just sent
            stopped = False
            for stream in list(self.stopping) if self.stopping else ():
                if stream.remote_closed or stream.closed:
                    self.stopping.discard(stream)
                elif not codec.queued_body_size(stream.id):  # the answer has left: RST_STREAM NO_ERROR (RFC 9113 8.1)
                    self.stopping.discard(stream)
                    stream.remote_closed = stopped = True
                    codec.reset_stream(stream.id, NO_ERROR)
            if stopped:
                self.transport.write(codec.data_to_send())
                self.handle_events()
        except ngh2.NGH2Error as exc:
            self.codec_failed(exc)
            return
        for stream in list(self.waiting) if self.waiting else ():
            if stream.closed or not stream.blocked:
                self.waiting.discard(stream)
                stream.wake()
        if not codec.want_read and not codec.want_write:
            self.end("the codec ended the connection")
        elif "stall" not in self.timers and self.streams and codec.queued_body_size():
            self.timers["stall"] = self.loop.call_later(min(1.0, self.policy.send_timeout_s / 4), self.check_stalls)

    def stream_done(self, stream: Stream) -> None:
        stream.closed = True
        self.waiting.discard(stream)
        self.stopping.discard(stream)
        stream.wake()
        if self.streams.pop(stream.id, None) is not None:
            self.header_bytes -= stream.header_bytes
            if not self.streams:
                self.idle()
                if self.going_away:
                    self.loop.call_soon(self.end, "gone away, its last call over")

    def go_away(self, code: int = NO_ERROR, reason: bytes = b"") -> None:
        """No new streams; those under way finish (within the age grace), then the connection ends.
        With an error code, it ends as soon as the GOAWAY is out."""
        if self.going_away or self.transport is None or self.ended:
            return
        self.going_away = True
        try:
            self.codec.send_goaway(code, debug_data=reason)
        except ngh2.NGH2Error:
            pass
        self.flush()
        if code != NO_ERROR:
            self.end(reason.decode("latin-1"))
        elif not self.streams:
            self.loop.call_soon(self.end, "gone away")
        else:
            self.timers["grace"] = self.loop.call_later(self.policy.age_grace_s, self.close)

    def end(self, why: str) -> None:
        """Writes nothing more; reads and drops what the peer still sends for LINGER_S (so it reads
        our GOAWAY rather than a reset), then closes, and aborts a socket that still will not drain."""
        if self.ended or self.transport is None:
            return
        log.debug("HTTP/2 connection from %s ending: %s", self.peer, why)
        self.ended, self.backlog = True, b""
        for timer in self.timers.values():
            timer.cancel()
        for stream in list(self.streams.values()):
            self.stream_gone(stream)
        transport = self.transport
        if transport.is_closing():
            return
        transport.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)
        self.loop.call_later(2 * LINGER_S, transport.abort)

    def idle(self) -> None:
        """The idle clock starts: one timer, checked as it fires (a timer a call cost ~1 us a call)."""
        if self.policy.idle_timeout_s > 0 and not self.lost:
            self.idle_since = self.loop.time()
            if "idle" not in self.timers:
                self.timers["idle"] = self.loop.call_later(self.policy.idle_timeout_s, self.go_away_if_idle)

    def cancel_timer(self, name: str) -> None:
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def go_away_if_idle(self) -> None:
        del self.timers["idle"]
        if self.streams:  # busy: the clock starts again when its last call is over
            return
        left = self.idle_since + self.policy.idle_timeout_s - self.loop.time()
        if left > 0:  # it was busy meanwhile
            self.timers["idle"] = self.loop.call_later(left, self.go_away_if_idle)
        else:
            self.go_away()
