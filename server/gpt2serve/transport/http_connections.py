"""REST connections bounded as NGINX and Envoy bound them, so no client can hold the server:

- a connection past `--http-max-connections` (this front end's) is closed at once, before any
  byte is read, and counted (gpt2serve_connections_refused_total{api="rest"});
- a request must arrive whole, headers and body, within `--http-request-timeout-s` of its first
  byte (or of the connection's opening): a slowloris sending a header line a second is closed;
- between requests, uvicorn's keep-alive limit (`--http-keep-alive-s`) closes idle connections.

uvicorn has the keep-alive limit but neither of the others, so they are a subclass of its
httptools protocol: the clock starts when a connection opens or a request begins, and stops
once the request has been read (a slow answer, a long stream, is the server's own time).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def bounded_http_protocol(max_connections: int, request_timeout_s: float, refused: Callable[[], None]) -> type:
    """uvicorn's `http` protocol class with this front end's limits; `refused()` counts a refusal."""

    class BoundedHttpProtocol(HttpToolsProtocol):
        _refused = False
        _request_clock: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:  # every open connection of this server
                self._refused = True
                refused()
                transport.abort()  # no answer: reading a request would already cost what the limit saves
                return
            super().connection_made(transport)
            self._start_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._stop_clock()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._start_clock()

        def on_message_complete(self) -> None:
            self._stop_clock()
            super().on_message_complete()

        def _start_clock(self) -> None:
            self._stop_clock()
            self._request_clock = self.loop.call_later(request_timeout_s, self._too_slow)

        def _stop_clock(self) -> None:
            if self._request_clock is not None:
                self._request_clock.cancel()
                self._request_clock = None

        def _too_slow(self) -> None:
            """The request is not in after its time: close the connection (no handler has started)."""
            self._request_clock = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedHttpProtocol
