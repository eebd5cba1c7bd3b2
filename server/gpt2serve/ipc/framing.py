"""Both ends of the IPC door frame messages the same way: what one event-loop tick (or one pass of
the engine's IPC thread) sends goes out as one frame per peer (64 answers of one batch cost one
frame per front end, not 64), and each frame received is handed over message by message; a frame
that does not decode is logged and dropped, and one message's failure is never the receive
loop's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Hashable

import zmq

from . import codec
from .codec import BadFrame

log = logging.getLogger(__name__)
# The socket options and flags both ends use on every pass, as plain ints: pyzmq's enum members
# cost more to pass than the calls they go with.
EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


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
