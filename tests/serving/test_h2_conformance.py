"""RFC 9113's rules on the default gRPC server's wire, from a raw client: a malformed request is a
stream error before any handler runs (section 8), frames that break the frame and stream-state
rules end the connection with the right GOAWAY code, and a call runs its handler once whatever
frames follow on its stream. Each of these was served, ignored or crashed on the hand-written
stack at 139f00f (h2spec: 43 failures); libnghttp2 checks them now.
"""

from __future__ import annotations

import socket
import struct
import time

import hpack
import ngh2
import pytest

from support.h2_attacks import (
    NEXT_TOKEN_REQUEST, PREFACE, SETTINGS_ACK, Frame, frame, read_frames, request_headers,
)
from support.servers import metric_value

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, GOAWAY, WINDOW_UPDATE = 0, 1, 2, 3, 4, 7, 8
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 1, 3, 5, 6, 9
NEXT_TOKENS = ("gpt2serve_requests_total", {"api": "grpc", "method": "NextToken", "status": "OK"})


def exchange(server, payload: bytes, seconds: float = 1.5) -> list[Frame]:
    """The preface (and an ack of the server's SETTINGS), `payload`; then every frame the server sends."""
    host, port = server.grpc_target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + SETTINGS_ACK + payload)
        return read_frames(sock, seconds)


def goaway_code(frames) -> int | None:
    return next((int.from_bytes(p[4:8], "big") for t, _, _, p in frames if t == GOAWAY), None)


def reset_code(frames, stream_id: int) -> int | None:
    return next((int.from_bytes(p, "big") for t, _, s, p in frames if t == RST_STREAM and s == stream_id), None)


def call(headers: list[tuple[str, str]], body: bytes = NEXT_TOKEN_REQUEST, end: bool = True) -> bytes:
    block = hpack.Encoder().encode(headers)
    return frame(HEADERS, 0x4, 1, block) + frame(DATA, 0x1 if end else 0, 1, body)


GOOD = request_headers("x")
MALFORMED = {
    "an uppercase name": GOOD + [("X-Upper", "1")],
    "a duplicate :path": GOOD + [(":path", "/gpt2serve.v1.Gpt2Serve/GetModelInfo")],
    "no :method": [h for h in GOOD if h[0] != ":method"],
    "no :scheme": [h for h in GOOD if h[0] != ":scheme"],
    "no :path": [h for h in GOOD if h[0] != ":path"],
    "a pseudo-header after a regular one": GOOD[:4] + [("content-type", "application/grpc"), (":authority", "y")],
    "a connection-specific header": GOOD + [("connection", "keep-alive")],
    "te other than trailers": [h for h in GOOD if h[0] != "te"] + [("te", "gzip")],
    "an unknown pseudo-header": GOOD + [(":unknown", "1")],
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_request_is_a_stream_error_and_no_handler_runs(server, what):
    before = metric_value(server.http_url, *NEXT_TOKENS)
    frames = exchange(server, call(MALFORMED[what]))
    assert reset_code(frames, 1) == PROTOCOL_ERROR, frames
    assert metric_value(server.http_url, *NEXT_TOKENS) == before


def test_a_body_longer_than_its_content_length_is_a_stream_error(server):
    before = metric_value(server.http_url, *NEXT_TOKENS)
    frames = exchange(server, call(GOOD + [("content-length", "3")]))
    assert reset_code(frames, 1) == PROTOCOL_ERROR, frames
    assert metric_value(server.http_url, *NEXT_TOKENS) == before


def test_a_call_runs_once_whatever_headers_follow_on_its_stream(server):
    """Trailers (an empty HEADERS with END_STREAM) sent again and again: one NextToken, and the
    connection ended (STREAM_CLOSED): the hand-written stack ran the handler once for each."""
    before = metric_value(server.http_url, *NEXT_TOKENS)
    again = frame(HEADERS, 0x5, 1)
    frames = exchange(server, call(GOOD, end=False) + again * 21)
    assert goaway_code(frames) == STREAM_CLOSED, frames
    time.sleep(0.3)
    assert metric_value(server.http_url, *NEXT_TOKENS) - before <= 1


FRAME_RULES = {
    "DATA on stream 0": (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    "DATA on an idle stream": (frame(DATA, 0, 5, b"x"), PROTOCOL_ERROR),
    "HEADERS on stream 0": (frame(HEADERS, 0x4, 0, hpack.Encoder().encode(GOOD)), PROTOCOL_ERROR),
    "RST_STREAM of the wrong length": (call(GOOD, end=False) + frame(RST_STREAM, 0, 1, b"\0\0\0"), FRAME_SIZE_ERROR),
    "RST_STREAM on an idle stream": (frame(RST_STREAM, 0, 7, struct.pack(">I", 8)), PROTOCOL_ERROR),
    "WINDOW_UPDATE of 0 on the connection": (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)), PROTOCOL_ERROR),
    "the connection window past 2^31-1": (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
                                          FLOW_CONTROL_ERROR),
    "a truncated HPACK literal": (frame(HEADERS, 0x5, 1, b"\x00\x85ab"), COMPRESSION_ERROR),
    "a table size update after a header": (frame(HEADERS, 0x5, 1, hpack.Encoder().encode(GOOD) + b"\x20"),
                                           COMPRESSION_ERROR),
    "a HEADERS of a client's even stream id": (frame(HEADERS, 0x5, 2, hpack.Encoder().encode(GOOD)), PROTOCOL_ERROR),
}


@pytest.mark.parametrize("what", list(FRAME_RULES))
def test_a_frame_that_breaks_the_rules_ends_the_connection_with_its_code(server, what):
    payload, code = FRAME_RULES[what]
    frames = exchange(server, payload)
    assert goaway_code(frames) == code, frames


def test_priority_of_the_wrong_length_and_a_stream_window_past_2_31_are_errors(server):
    """RFC 9113 makes both stream errors; libnghttp2 ends the connection instead (h2spec 6.3/1 and
    6.9.1/3, its own choice, docs/deploy.md): either way the frame is not taken."""
    frames = exchange(server, frame(PRIORITY, 0, 3, b"\0\0\0\0"))
    assert reset_code(frames, 3) == FRAME_SIZE_ERROR or goaway_code(frames) == FRAME_SIZE_ERROR, frames
    frames = exchange(server, call(GOOD, end=False) + frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 2**31 - 1)))
    assert reset_code(frames, 1) == FLOW_CONTROL_ERROR or goaway_code(frames) == FLOW_CONTROL_ERROR, frames


def test_the_server_advertises_its_limits(server):
    settings = [p for t, f, _, p in exchange(server, b"", 0.5) if t == SETTINGS and not f & 1][0]
    values = dict(struct.iter_unpack(">HI", settings))
    assert values[0x6] == 16384  # MAX_HEADER_LIST_SIZE, as gRPC's core
    assert values[0x3] == 256  # MAX_CONCURRENT_STREAMS (--grpc-max-concurrent-streams)
    assert values[0x4] == 4 << 20  # INITIAL_WINDOW_SIZE


def test_the_codecs_flood_limits_are_on():
    """ngh2 is alpha: the limits this server relies on are checked to be its defaults still."""
    config = ngh2.Configuration()
    assert config.stream_reset_rate_limit[0] > 0 and config.glitch_rate_limit[0] > 0
    assert 0 < config.max_continuations <= 16 and 0 < config.max_outbound_ack <= 1000
    assert 0 < config.max_settings <= 64
