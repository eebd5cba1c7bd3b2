"""What the built-in gRPC server's connections (h2_connection) hold a client to, beyond what
libnghttp2 holds it to: a token bucket for frames that do no work, answers the client does not
read, the GOAWAY for a codec that failed, the linger after it, and a log that a flood cannot fill."""

from __future__ import annotations

import logging
import struct
import time

import ngh2

from .h2_stream import CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM, INTERNAL_ERROR, PROTOCOL_ERROR, Stream

LINGER_S = 1.0  # after our GOAWAY, how long the peer's bytes are read and dropped before the socket closes
LINGER_BYTES = 1 << 20  # and how many: a peer still sending more is not reading, and is cut off


class RateLimitedLog:
    """One line per `interval_s` at most; the lines left out are counted in the next."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0):
        self.log, self.interval_s, self.next_at, self.left_out = log, interval_s, 0.0, 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.left_out += 1
            return
        if self.left_out:
            message += f" ({self.left_out} more since the last line)"
        self.next_at, self.left_out = now + self.interval_s, 0
        self.log.warning(message, *args)


class TokenBucket:
    def __init__(self, burst: int, rate: float):
        self.burst, self.rate, self.tokens, self.at = burst, rate, float(burst), time.monotonic()

    def take(self) -> bool:
        """False once the bucket is empty."""
        if self.tokens < 1.0:
            now = time.monotonic()
            self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.rate), now
            if self.tokens < 1.0:
                return False
        self.tokens -= 1.0
        return True

    def give(self, tokens: float) -> None:
        """Tokens earned (not by time), up to the burst."""
        self.tokens = min(self.burst, self.tokens + tokens)


class SlowPeers:
    """Http2Connection's answers held by a peer that gives them no window (the state is the
    connection's): past `send_timeout_s` with no progress, the stream is reset."""

    def over_window(self, stream: Stream) -> bool:
        """More of the stream's answer is queued than the peer's windows let out."""
        try:
            queued = self.codec.queued_body_size(stream.id)
            return queued > 0 and queued > min(self.codec.stream_remote_window_size(stream.id),
                                               self.codec.remote_window_size)
        except ngh2.NGH2Error:
            return False

    def check_stalls(self) -> None:
        """Resets the streams whose answers have waited `send_timeout_s` for the peer's window with
        no progress, so calls held at window 0 cannot keep a connection (or a call) forever."""
        self.timers.pop("stall", None)
        if self.ended:
            return
        now, waited = time.monotonic(), False
        for stream in list(self.streams.values()):
            if not self.over_window(stream):
                stream.stalled_since = None
                continue
            waited, queued = True, self.codec.queued_body_size(stream.id)
            if stream.stalled_since is None or queued < stream.stalled_queue:
                stream.stalled_since, stream.stalled_queue = now, queued
            elif now - stream.stalled_since >= self.policy.send_timeout_s:
                stream.reset(CANCEL)
                self.stream_gone(stream)
        if waited:
            self.timers["stall"] = self.loop.call_later(min(1.0, self.policy.send_timeout_s / 4), self.check_stalls)

    @property
    def stalled(self) -> bool:
        """Every call open has an answer waiting on a peer that gives it no window (an eviction's first choice)."""
        return bool(self.streams) and all(self.over_window(s) for s in self.streams.values())


def goaway_frame(last_stream_id: int, code: int, reason: bytes) -> bytes:
    """A GOAWAY written by hand, for when the codec itself can no longer be used."""
    payload = struct.pack(">II", last_stream_id, code) + reason[:200]
    return len(payload).to_bytes(3, "big") + b"\x07\x00\x00\x00\x00\x00" + payload  # type 7, no flags, stream 0


def fatal_code(exc: ngh2.NGH2Error) -> int:
    """The GOAWAY code for an error that ended the codec."""
    if isinstance(exc, ngh2.DenialOfServiceError):
        return ENHANCE_YOUR_CALM
    if "compression" in str(exc).lower() or "header" in str(exc).lower():
        return COMPRESSION_ERROR
    return INTERNAL_ERROR if isinstance(exc, ngh2.InternalError) else PROTOCOL_ERROR
