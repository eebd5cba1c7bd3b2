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
httptools protocol: the request's clock starts when a connection opens or a request begins, and
stops once the request has been read (a slow answer, a long stream, is the server's own time).
Both limits are deadlines one sweep a server reads (ClockSweep), not a timer each.
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
        """Both time limits are deadlines on the connection, read by one sweep a front end
        (ClockSweep), not timers of their own: uvicorn armed and cancelled a keep-alive timer for
        each answer, and the request clock two more, about a tenth of a REST call's HTTP work."""

        _refused = False
        # By when (monotonic) the connection must have read its request, or begun the next one
        # when idle between requests; None: busy with a request (its answer is the server's own time).
        _deadline: float | None = None
        # Since when it has been waiting for a request's headers (monotonic); None: busy with a request.
        _waiting_since: float | None = None
        _direct: tuple = ()  # (cycle, task) of the direct route answering this connection's request
        _sweep: ClockSweep | None = None  # the class's: its server's

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
            self._waiting_since = now = time.monotonic()
            self._deadline = now + request_timeout_s
            cls = type(self)
            if cls._sweep is None:  # one class a server (Transports.start), so one sweep a server
                cls._sweep = ClockSweep(self.loop, self.connections, min(request_timeout_s, self.timeout_keep_alive))
            cls._sweep.start()

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

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._deadline = time.monotonic() + request_timeout_s

        def on_headers_complete(self) -> None:
            self._waiting_since = None  # a request under way: its connection stays
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._deadline = None
            super().on_message_complete()

        def on_response_complete(self) -> None:
            """uvicorn's, with the keep-alive limit as a deadline instead of a timer."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self.flow.resume_reading()
            if self.pipeline:  # a pipelined request starts now
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:  # kept alive for the next request's headers
                self._waiting_since = now = time.monotonic()
                self._deadline = now + self.timeout_keep_alive

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._deadline = None
            super().connection_lost(exc)
            if self._direct:
                cycle, task = self._direct
                if not task.done() and not cycle.response_complete:
                    cycle.disconnected = True
                    task.cancel()  # a hang-up: the call leaves the queue (http_direct.DirectRoutes.serve)

    return BoundedHttpProtocol


class ClockSweep:
    """The time limits of one server's connections: every tenth of the shortest limit (within
    50 ms .. 1 s), close each connection past its deadline (no handler has started on it). The
    sweep stops when no connection is left, and the next one to open starts it again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: set, shortest_s: float):
        self.loop, self.connections = loop, connections
        self.period_s = min(max(shortest_s / 10, 0.05), 1.0)
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_later(self.period_s, self.sweep)

    def sweep(self) -> None:
        self.timer = None
        now = time.monotonic()
        for connection in list(self.connections):
            deadline = connection._deadline
            if deadline is not None and now >= deadline and not connection.transport.is_closing():
                connection._deadline = None
                connection.transport.close()
        if self.connections:
            self.start()
