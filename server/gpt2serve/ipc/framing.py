"""Both ends of the IPC door frame messages the same way: what one event-loop tick (or one pass of
the engine's IPC thread) sends goes out as one frame per peer (64 answers of one batch cost one
frame per front end, not 64), and each frame received is handed over message by message; a frame
that does not decode is logged and dropped, and one message's failure is never the receive
loop's.

On the socket (a Unix stream socket, ipc.engine_server) a frame is its length, 4 bytes little
endian, then its bytes; FrameReader cuts the stream back into frames.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any, Callable, Hashable

from . import codec
from .codec import BadFrame

log = logging.getLogger(__name__)
LENGTH = struct.Struct("<I")  # a frame's length, before it on the socket
MAX_FRAME_BYTES = 1 << 30  # a length past this is a broken stream, not a frame


class BrokenStream(ValueError):
    """The byte stream no longer starts at a frame: the connection is closed."""


class FrameReader:
    """A socket's bytes, as they come, cut into whole frames. A frame that came in pieces is
    joined once, when its last piece is in (not at every piece)."""

    __slots__ = ("_pieces", "_size", "_need")

    def __init__(self):
        self._pieces: list[bytes] = []  # bytes after the last whole frame
        self._size = 0  # their length
        self._need = 4  # the length the pieces must reach before another frame can be cut

    def feed(self, data: bytes) -> list[bytes]:
        """The frames `data` completes, in order."""
        if self._pieces:
            self._pieces.append(data)
            self._size += len(data)
            if self._size < self._need:
                return []
            data = b"".join(self._pieces)
            self._pieces.clear()
        frames = []
        at, end = 0, len(data)
        while end - at >= 4:
            (size,) = LENGTH.unpack_from(data, at)
            if size > MAX_FRAME_BYTES:
                raise BrokenStream(f"a frame of {size} bytes")
            if end - at - 4 < size:
                break
            frames.append(data[at + 4:at + 4 + size])
            at += 4 + size
        if at < end:
            rest = data[at:]
            self._pieces.append(rest)
            self._size = len(rest)
            self._need = 4 if len(rest) < 4 else 4 + LENGTH.unpack_from(rest)[0]  # a length the loop checked
        return frames


class Outbox:
    """What is put in one tick, a frame per peer. On an event loop it flushes itself at the end of
    the tick; with `flushed_by_owner` (a plain IO thread) the owner calls flush() after each pass."""

    def __init__(self, send: Callable[[Any, bytes], None], flushed_by_owner: bool = False):
        self._send = send  # send(peer, frame)
        self._messages: dict[Hashable, list] = {}
        self._on_loop = not flushed_by_owner

    def put(self, peer: Hashable, message: Any) -> None:
        if not self._messages and self._on_loop:
            asyncio.get_running_loop().call_soon(self.flush)
        self._messages.setdefault(peer, []).append(message)

    def last(self, peer: Hashable) -> Any:
        """The last message put for `peer` in this tick, if any (to extend it in place)."""
        messages = self._messages.get(peer)
        return messages[-1] if messages else None

    def flush(self) -> None:
        if not self._messages:
            return
        messages, self._messages = self._messages, {}
        for peer, batch in messages.items():
            self._send(peer, codec.encode(batch))


def deliver(frame: bytes, handle: Callable[[Any], None], sender: str) -> None:
    """Each message of `frame` to `handle`, in order (`sender` names the other end in the log)."""
    try:
        messages = codec.decode(frame)
    except BadFrame as exc:
        log.error("dropped a frame from %s that does not decode: %s", sender, exc)
        return
    for message in messages:
        try:
            handle(message)
        except Exception:
            log.exception("handling a %s message from %s failed", type(message).__name__, sender)
