"""REST connections bounded as NGINX and Envoy bound them, so no client can hold the server:

- at `--http-max-connections` (this front end's), a new connection takes the place of the
  oldest one that has not sent a request's headers (a fresh connection still silent, a
  slowloris dripping its headers, or a keep-alive connection idle between requests), which is
  closed and counted (gpt2serve_connections_evicted_total{api="rest"}); NGINX drains its idle
  and waiting connections the same way when it runs out. Only when every connection is busy
  with a request is the new one closed at once, before any byte is read, and counted
  (gpt2serve_connections_refused_total{api="rest"}). So connections that send nothing can never
  keep a well-behaved client out;
- a request must arrive whole, headers and body, within `--http-request-timeout-s` of its first
  byte (or of the connection's opening): a slowloris sending a header line a second is closed;
- between requests, uvicorn's keep-alive limit (`--http-keep-alive-s`) closes idle connections.

uvicorn has the keep-alive limit but neither of the others, so they are a subclass of its
httptools protocol: the clock starts when a connection opens or a request begins, and stops
once the request has been read (a slow answer, a long stream, is the server's own time).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http_direct import DirectRoutes


def bounded_http_protocol(max_connections: int, request_timeout_s: float, refused: Callable[[], None],
                          evicted: Callable[[], None] = lambda: None, direct: DirectRoutes | None = None) -> type:
    """uvicorn's `http` protocol class with this front end's limits; `refused()` counts a
    refusal, `evicted()` a connection closed to make room for a new one. POSTs to `direct`'s
    paths are answered by it, not through ASGI (transport.http_direct)."""
    direct_paths = direct.paths if direct is not None else frozenset()

    class BoundedHttpProtocol(HttpToolsProtocol):
        _refused = False
        _request_clock: asyncio.TimerHandle | None = None
        # Since when it has been waiting for a request's headers (monotonic); None: busy with a request.
        _waiting_since: float | None = None
        _direct: tuple = ()  # (cycle, task) of the direct route answering this connection's request

        def _start_asgi_task(self, cycle, app) -> None:
            scope = cycle.scope
            if scope["path"] not in direct_paths or scope["method"] != "POST":
                return super()._start_asgi_task(cycle, app)
            task = self.loop.create_task(direct.serve(cycle))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)  # the graceful shutdown waits for it
            self._direct = (cycle, task)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections and not self._evict_one():  # this server's connections
                self._refused = True
                refused()
                transport.abort()  # no answer: reading a request would already cost what the limit saves
                return
            super().connection_made(transport)
            self._waiting_since = time.monotonic()
            self._start_clock()

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest without a request's headers, if any."""
            waiting = [c for c in self.connections if c._waiting_since is not None and not c.transport.is_closing()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._waiting_since)
            oldest._waiting_since = None
            oldest.transport.abort()  # its connection_lost takes it out of the set
            evicted()
            return True

        def on_headers_complete(self) -> None:
            self._waiting_since = None  # a request under way: its connection stays
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            idle = not self.pipeline  # else a pipelined request starts now
            super().on_response_complete()
            if idle and not self.transport.is_closing():
                self._waiting_since = time.monotonic()  # kept alive for the next request's headers

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._stop_clock()
            super().connection_lost(exc)
            if self._direct:
                cycle, task = self._direct
                if not task.done() and not cycle.response_complete:
                    cycle.disconnected = True
                    task.cancel()  # a hang-up: the call leaves the queue (http_direct.DirectRoutes.serve)

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
