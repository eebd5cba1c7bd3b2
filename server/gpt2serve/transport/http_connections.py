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
- between requests, uvicorn's keep-alive limit (`--http-keep-alive-s`) closes idle connections;
- a request's head is bounded as NGINX bounds it: a request line past `--http-max-request-line-bytes`
  is answered 414, a header section past `--http-max-header-bytes` 431 (counted as its bytes
  arrive, so one endless header line is cut off at the limit, not held whole), and an HTTP/1.1
  request without exactly one Host 400 (RFC 9112 3.2); each closes its connection;
- a client that pipelines requests is read ahead of its answers by at most PIPELINE_DEPTH
  requests: reading waits until the queued ones are answered, and a request past the depth ends
  the connection once those are (RFC 9112 9.3.2: the client retries what was not answered).
  uvicorn read on after every answer, so a client that sent requests and never read the answers
  had them queued without bound (700 MiB for 13 MiB of `GET /healthz`).

A request asking to upgrade to a protocol this server does not speak (`Upgrade: h2c`, which
`curl --http2` sends with every request to an http:// URL) is answered in HTTP/1.1, the upgrade
ignored as RFC 9110 section 7.8 allows, its body read in full (NGINX does the same).

uvicorn has the keep-alive limit but neither of the others, so they are a subclass of its
httptools protocol: the request's clock starts when a connection opens or a request begins, and
stops once the request has been read (a slow answer, a long stream, is the server's own time).
Both limits are deadlines one sweep a server reads (ClockSweep), not a timer each.
"""

from __future__ import annotations

import asyncio
import time
from operator import itemgetter
from typing import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .http_direct import DirectCall, DirectRoutes

PIPELINE_DEPTH = 64  # requests a connection may have read and queued ahead of its answer


class PipelineFull(Exception):
    """Raised from the parser's callback to stop reading a connection's requests."""


class RequestRefused(Exception):
    """Raised from the parser's callback to answer a request's head with an error and close."""


def bounded_http_protocol(max_connections: int, request_timeout_s: float, refused: Callable[[], None],
                          evicted: Callable[[], None] = lambda: None, direct: DirectRoutes | None = None,
                          max_header_bytes: int = 16384, max_request_line_bytes: int = 8192) -> type:
    """uvicorn's `http` protocol class with this front end's limits; `refused()` counts a
    refusal, `evicted()` a connection closed to make room for a new one. POSTs to `direct`'s
    paths are answered by it, not through ASGI (transport.http_direct)."""
    direct_paths = direct.raw_paths if direct is not None else frozenset()
    max_body = direct.guard.max_body_bytes if direct is not None else 0

    class BoundedHttpProtocol(HttpToolsProtocol):
        """Both time limits are deadlines on the connection, read by one sweep a front end
        (ClockSweep), not timers of their own: uvicorn armed and cancelled a keep-alive timer for
        each answer, and the request clock two more, about a tenth of a REST call's HTTP work.

        A request to a direct route is a DirectCall from its headers on; uvicorn's scope and
        request cycle are made only for the others, at their headers (so on_message_begin
        leaves the scope to on_headers_complete)."""

        _refused = False
        # By when (monotonic) the connection must have read its request, or begun the next one
        # when idle between requests; None: busy with a request (its answer is the server's own time).
        _deadline: float | None = None
        # Since when it has been waiting for a request's headers (monotonic); None: busy with a request.
        _waiting_since: float | None = None
        _answering: DirectCall | None = None  # the direct call whose route runs, if one does
        _pipeline_full = False  # PIPELINE_DEPTH requests queued and more sent: answer those, then close
        _sweep: ClockSweep | None = None  # the class's: its server's
        # Of a request whose upgrade is ignored: its body's bytes still to read (llhttp takes the
        # request to end at its headers and stops there, so the body is read here); None: no such request.
        _upgrade_body_left: int | None = None
        _in_head = False  # between a request's first byte and the end of its headers
        _head_bytes = 0  # of the request's head read so far (the read it began in counted whole)
        _read_bytes = 0  # of the read being parsed
        _refusal: tuple[int, str] | None = None  # the answer to a head refused from a parser callback

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
            if len(self.pipeline) >= PIPELINE_DEPTH:
                self._pipeline_full = True
                raise PipelineFull
            self.url, self.headers, self.expect_100_continue = b"", [], False
            self._deadline = time.monotonic() + request_timeout_s
            self._in_head, self._head_bytes = True, 0

        def on_url(self, url: bytes) -> None:
            self.url += url
            if len(self.url) > max_request_line_bytes:
                self._refuse(414, f"The request line is longer than {max_request_line_bytes} bytes "
                                  "(--http-max-request-line-bytes).")

        def _refuse(self, status: int, message: str) -> None:
            self._refusal = (status, message)
            raise RequestRefused

        def _refuse_large_head(self) -> None:
            self._refuse(431, f"The request's header section is larger than {max_header_bytes} bytes "
                              "(--http-max-header-bytes).")

        def _check_head(self) -> None:
            """At the headers' end: the section's size (the reads before were checked as they came),
            and HTTP/1.1's one Host. The size is counted only where the reads the head came in
            could hold more than the limit: a request in one small read (most) skips it."""
            headers = self.headers
            if self._head_bytes + self._read_bytes > max_header_bytes:
                if len(self.url) + sum(len(name) + len(value) + 4 for name, value in headers) > max_header_bytes:
                    self._refuse_large_head()
            hosts = list(map(itemgetter(0), headers)).count(b"host")
            if hosts != 1 and (hosts or self.parser.get_http_version() == "1.1"):
                self._refuse(400, "An HTTP/1.1 request carries exactly one Host header (RFC 9112 section 3.2).")

        def on_headers_complete(self) -> None:
            self._check_head()
            self._in_head = False
            self._waiting_since = None  # a request under way: its connection stays
            parser = self.parser
            upgrade = False  # to a WebSocket, made by uvicorn (when it has a WebSocket protocol)
            if parser.should_upgrade():
                upgrade = self._should_upgrade()  # reads the headers: only when asked
                if not upgrade:
                    self._upgrade_body_left = self._content_length()
            if self.url in direct_paths and parser.get_method() == b"POST" and not upgrade:
                return self._take_direct()
            url, headers, expect_100 = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # uvicorn's scope, for its request cycle
            self.url, self.expect_100_continue = url, expect_100
            self.headers += headers  # the scope's list
            super().on_headers_complete()

        # A request whose upgrade is ignored -------------------------------------------------------

        def data_received(self, data: bytes) -> None:
            """uvicorn's, but a request asking for an upgrade uvicorn does not make goes on in
            HTTP/1.1: its body is read here and a fresh parser takes the bytes after it."""
            self._unset_keepalive_if_required()
            if self._upgrade_body_left is not None and self._upgrade_body_left > 0:
                data = self._ignored_upgrade_body(data)
            self._read_bytes = len(data)
            try:
                self.parser.feed_data(data)
                if self._in_head:
                    self._head_bytes += len(data)
                    if self._head_bytes > max_header_bytes:  # an unfinished head is not held past the limit
                        self._refuse_large_head()
            except (httptools.HttpParserError, RequestRefused):
                if self._refusal is not None:
                    return self._send_refusal(*self._refusal)
                if self._pipeline_full:  # nothing more is read; the connection ends after the queued answers
                    self.flow.pause_reading()
                    return
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            except httptools.HttpParserUpgrade as stop:
                if self._upgrade_body_left is None:  # on_headers_complete found it one uvicorn makes
                    return self.handle_websocket_upgrade()
                if self._upgrade_body_left < 0:  # a chunked body: llhttp cannot be told to read it
                    self._upgrade_body_left = None
                    return self.send_400_response("A request with Upgrade must give its body's Content-Length.")
                self.parser = httptools.HttpRequestParser(self)
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
                if self._upgrade_body_left == 0:
                    self._upgrade_body_left = None
                rest = data[stop.args[0]:]
                if rest:
                    self.data_received(rest)

        def _send_refusal(self, status: int, message: str) -> None:
            """uvicorn's 400 answer, with this status: its headers, the message, and the connection closed."""
            self._deadline = None
            content = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            body = message.encode("ascii")
            content.extend([b"content-type: text/plain; charset=utf-8\r\n",
                            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                            b"connection: close\r\n\r\n", body])
            self.transport.write(b"".join(content))
            self.transport.close()

        def _content_length(self) -> int:
            """The request's Content-Length (0 without one), or -1 for a chunked body."""
            length = 0
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return -1
                if name == b"content-length":
                    length = int(value)  # llhttp has checked it is a number
            return length

        def _ignored_upgrade_body(self, data: bytes) -> bytes:
            """The body's bytes in `data` to the request; what follows it, returned."""
            left = self._upgrade_body_left
            body, rest = data[:left], data[left:]
            self._upgrade_body_left = left - len(body)
            self.on_body(body)
            if not self._upgrade_body_left:
                self._upgrade_body_left = None
                self.on_message_complete()
            return rest

        # A direct route's call --------------------------------------------------------------------

        def _take_direct(self) -> None:
            parser = self.parser
            call = DirectCall(self, self.url.decode("ascii"), self.headers, self.scheme,
                              parser.should_keep_alive() and parser.get_http_version() != "1.0",
                              self.expect_100_continue)
            call.refusal = direct.refusal(call)
            previous, self.cycle = self.cycle, call
            if previous is None or previous.response_complete:
                self._direct_turn(call)
            else:  # pipelined: its turn comes when the answer before it is written (on_response_complete)
                self.flow.pause_reading()
                call.queued = True
                self.pipeline.appendleft((call, None))

        def _direct_turn(self, call: DirectCall) -> None:
            """The call's answer is next on the connection: its route runs once the body is whole
            (or at once, when it is refused without it)."""
            call.queued = False
            if call.complete or call.refusal is not None:
                self._answer(call)
            elif call.expect_100:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        def _answer(self, call: DirectCall) -> None:
            call.task = task = self.loop.create_task(direct.serve(call))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)  # the graceful shutdown waits for it
            self._answering = call

        def _start_asgi_task(self, cycle, app) -> None:
            if type(cycle) is DirectCall:  # a pipelined direct call's turn
                return self._direct_turn(cycle)
            super()._start_asgi_task(cycle, app)

        def on_body(self, body: bytes) -> None:
            call = self.cycle
            if type(call) is not DirectCall:
                return super().on_body(body)
            if call.task is not None or call.refusal is not None:
                return  # answered, or to be, without its body: the rest is read and dropped
            call.size += len(body)
            if call.size > max_body:  # a chunked body past the limit, refused as it comes
                direct.too_large(call)
                if not call.queued:
                    self._answer(call)
                return
            call.parts.append(body)

        def on_message_complete(self) -> None:
            if self._upgrade_body_left is not None and self._upgrade_body_left != 0:
                return  # llhttp's, at the headers of a request whose upgrade is ignored: its body comes
            call = self.cycle
            if call is None or not call.response_complete:  # else answered early: the keep-alive clock runs
                self._deadline = None
            if type(call) is not DirectCall:
                return super().on_message_complete()
            call.complete = True
            if not call.queued and call.task is None:
                self._answer(call)

        # ------------------------------------------------------------------------------------------

        def on_response_complete(self) -> None:
            """uvicorn's, with the keep-alive limit as a deadline instead of a timer."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            if self.pipeline:  # a pipelined request starts now; reading waits until the last queued one
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            elif self._pipeline_full:
                self.transport.close()
            else:  # kept alive for the next request's headers
                self.flow.resume_reading()
                self._waiting_since = now = time.monotonic()
                self._deadline = now + self.timeout_keep_alive

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._deadline = None
            if type(self.cycle) is DirectCall:
                self.cycle = None  # uvicorn's own reads a cycle of its kind; the call is handled below
            super().connection_lost(exc)
            call = self._answering
            if call is not None and not call.response_complete and not call.task.done():
                call.disconnected = True
                call.task.cancel()  # a hang-up: the call leaves the queue (http_direct.DirectRoutes.serve)

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
