"""Messages gathered during one event-loop tick, then sent as one frame per peer: 64 answers of
one batch cost one frame per front end, not 64."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Hashable

from .. import protocol


class Outbox:
    def __init__(self, send: Callable[[Any, bytes], None]):
        self._send = send  # send(peer, frame)
        self._messages: dict[Hashable, list] = {}

    def put(self, peer: Hashable, message: Any) -> None:
        if not self._messages:
            asyncio.get_running_loop().call_soon(self._flush)
        self._messages.setdefault(peer, []).append(message)

    def _flush(self) -> None:
        messages, self._messages = self._messages, {}
        for peer, batch in messages.items():
            self._send(peer, protocol.encode(batch))
