"""What the peer's frames do to a built-in gRPC server connection (h2_connection.Http2Connection),
one method per event of the codec: streams opened, their data and end, resets, window updates,
SETTINGS and PING. Frames that cost work and bring none are counted (`waste`)."""

from __future__ import annotations

import time
from ngh2 import (
    DataReceived, GoAwayReceived, PingReceived, RequestReceived, SettingsReceived, StreamClosed, StreamReset,
    TrailersReceived, WindowUpdated,
)

from .h2_stream import ENHANCE_YOUR_CALM, HEADER_BUDGET, REFUSED_STREAM, Stream

JOIN = b"".join


class PeerEvents:
    """The event handlers of Http2Connection, which holds the state they read and write."""

    def request_received(self, event: RequestReceived) -> None:
        stream_id, headers = event.stream_id, event.headers
        if stream_id > self.last_stream_id:
            self.last_stream_id = stream_id
        size = 32 * len(headers) + len(JOIN(map(JOIN, headers)))  # as RFC 9113 counts a list
        if self.going_away or len(self.streams) >= self.policy.max_concurrent_streams:
            self.codec.reset_stream(stream_id, REFUSED_STREAM)  # the client may retry it
            return
        if self.header_bytes + size > HEADER_BUDGET:
            self.codec.reset_stream(stream_id, ENHANCE_YOUR_CALM)
            return
        stream = Stream(stream_id, self, size)
        self.streams[stream_id] = stream
        self.streams_opened += 1
        self.header_bytes += size
        self.app.stream_opened(stream, headers)
        if stream.listener is None:
            raise RuntimeError("the app left a stream without a listener")
        if event.end_stream and not stream.closed:
            stream.remote_closed = True
            stream.listener.end_received()

    def data_frame(self, event: DataReceived) -> None:
        stream_id, data = event.stream_id, event.data
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed or stream.closed:
            if data:
                self.codec.acknowledge_received_data(len(data), stream_id)  # counted and dropped
            return
        if data:
            stream.listener.data_received(data)  # it releases the bytes as it takes them
        elif not event.end_stream:
            self.waste("empty DATA")
        if event.end_stream:
            stream.remote_closed = True
            stream.listener.end_received()

    def trailers_received(self, event: TrailersReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None and not stream.remote_closed:  # the request's end; a call runs once
            stream.remote_closed = True
            stream.listener.end_received()

    def stream_reset(self, event: StreamReset) -> None:
        """Counted only: the codec's StreamClosed, which follows every reset, lets the stream go."""
        stream = self.streams.get(event.stream_id)
        if stream is not None and not stream.response_sent:
            self.waste("a running call reset")

    def stream_closed(self, event: StreamClosed) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            return
        if stream.response_sent:  # a call answered earns its client the frames that come with it
            self.wasted.give(self.policy.wasted_frames_per_call)
        self.stream_gone(stream)  # (also reset by the peer, or a stream error of the codec's: a malformed request)

    def stream_gone(self, stream: Stream) -> None:
        """The stream is over for the codec: its call is told (a no-op for a call that finished)."""
        self.stream_done(stream)
        if stream.listener is not None:
            stream.listener.reset_received()

    def window_updated(self, event: WindowUpdated) -> None:
        stream_id = event.stream_id
        if not stream_id:
            queued = self.codec.queued_body_size()
        else:
            queued = self.codec.queued_body_size(stream_id) if stream_id in self.streams else 0
        if not queued:
            self.waste("a window update with nothing waiting")

    def settings_received(self, event: SettingsReceived) -> None:
        if self.settings_seen:
            self.waste("SETTINGS")
            return
        self.settings_seen = True
        self.cancel_timer("handshake")

    def ping_received(self, event: PingReceived) -> None:
        now = time.monotonic()  # (the codec answers it)
        # As gRPC's server: pings closer together than the interval are strikes; answers sent clear them.
        if self.last_ping and now - self.last_ping < self.policy.min_ping_interval_s:
            self.ping_strikes += 1
            if self.ping_strikes > self.policy.max_ping_strikes:
                self.go_away(ENHANCE_YOUR_CALM, b"too_many_pings")
        self.last_ping = now

    def goaway_received(self, event: GoAwayReceived) -> None:
        self.going_away = True
        if not self.streams:
            self.end("the client sent GOAWAY")
