"""The built-in gRPC server (`--grpc-server builtin`): our HTTP/2 and gRPC layers on the front
end's own event loop, in place of grpc.aio's core, whose per-call cost is most of a unary call's.

It serves the same servicer, health (grpc.health.v1, Check and Watch) and reflection (v1 and v1alpha)
as grpc.aio does, with the same flags: streams past `--grpc-max-concurrent-streams` are refused
for the client to retry, and a socket that has not sent the preface and its SETTINGS within
`--grpc-handshake-timeout-s` is closed. At `--grpc-max-connections` a new connection takes the place
of the oldest one whose calls all wait on a client that does not read their answers, or else the
oldest that has opened no call, or else the oldest with none open (sent GOAWAY, which clients take
as "reconnect for the next call"; gpt2serve_connections_evicted_total{api="grpc"}), as NGINX drains
idle connections, so
connections that open and sit, or never read, never keep a client out; only when every
connection has calls in progress is the new one closed at once and counted
(gpt2serve_connections_refused_total{api="grpc"}).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Callable

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from .grpc_reflection import METHOD, V1_SERVICE, V1ALPHA_SERVICE
from .grpc_calls import BIDI, SERVER_STREAM, UNARY, GrpcApp, GrpcMethod, serialize
from .h2_connection import Http2Connection
from .h2_stream import ENHANCE_YOUR_CALM, ConnectionPolicy
from .sockets import bind_listening_socket

log = logging.getLogger(__name__)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def health_methods(servicer: health_aio.HealthServicer) -> dict[str, GrpcMethod]:
    """grpc.health.v1.Health from grpc_health's own servicer, the one the grpc.aio server runs."""
    request = health_pb2.HealthCheckRequest.FromString
    return {f"/{HEALTH_SERVICE}/Check": GrpcMethod(UNARY, servicer.Check, request, serialize),
            f"/{HEALTH_SERVICE}/Watch": GrpcMethod(SERVER_STREAM, servicer.Watch, request, serialize)}


def reflection_methods(service_names: tuple[str, ...]) -> dict[str, GrpcMethod]:
    """Server reflection, v1 and v1alpha (transport.grpc_reflection), from grpc_reflection's own
    servicer, a request at a time."""
    servicer = reflection.ReflectionServicer(service_names)

    async def info(requests, context):
        async for request in requests:
            for response in servicer.ServerReflectionInfo(iter((request,)), context):
                yield response

    method = GrpcMethod(BIDI, info, reflection_pb2.ServerReflectionRequest.FromString, serialize)
    return {f"/{name}/{METHOD}": method for name in (V1ALPHA_SERVICE, V1_SERVICE)}


class RefusedConnection(asyncio.Protocol):
    """A connection past the limit: closed before a byte is read."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.abort()


class BuiltinGrpcServer:
    def __init__(self, app: GrpcApp, policy: ConnectionPolicy, max_connections: int,
                 on_refused: Callable[[], None], on_evicted: Callable[[], None] = lambda: None):
        self.app, self.policy, self.max_connections = app, policy, max_connections
        self.on_refused, self.on_evicted = on_refused, on_evicted
        self.connections: dict[Http2Connection, None] = {}  # oldest first
        self.server: asyncio.AbstractServer | None = None

    def connection(self) -> asyncio.Protocol:
        if len(self.connections) >= self.max_connections and not self.evict_one():
            self.on_refused()
            return RefusedConnection()
        connection = Http2Connection(self.app, self.policy, on_closed=self.forget)
        self.connections[connection] = None
        return connection

    def forget(self, connection: Http2Connection) -> None:
        self.connections.pop(connection, None)

    def evict_one(self) -> bool:
        """Sends away the oldest connection whose every call waits on a client that does not read,
        or else the oldest that has opened no call, or else the oldest with no call open, if any."""
        candidates = [c for c in self.connections  # (no transport yet: still in its TLS handshake)
                      if c.transport is not None and not c.going_away and not c.ended]
        # A client that sends nothing or reads nothing before one that is between its calls.
        victim = (next((c for c in candidates if c.stalled), None)
                  or next((c for c in candidates if not c.streams and not c.streams_opened), None)
                  or next((c for c in candidates if not c.streams), None))
        if victim is None:
            return False
        self.forget(victim)
        if victim.streams:  # its calls cannot finish while the client does not read
            victim.go_away(ENHANCE_YOUR_CALM, b"evicted: the answers are not read")
        else:
            victim.go_away()  # with no stream open it closes at once
        self.on_evicted()
        return True

    async def listen(self, host: str, port: int, tls: tuple[str, str] | None = None, reuse_port: bool = False) -> int:
        """`reuse_port`: the front ends of --workers N share the port."""
        sock = bind_listening_socket(host, port, reuse_port, flag="--grpc-port")
        context = None
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls[0], tls[1])
            context.set_alpn_protocols(["h2"])
        self.server = await asyncio.get_running_loop().create_server(  # a TLS handshake within the same timeout
            self.connection, sock=sock, ssl=context, backlog=1024,
            ssl_handshake_timeout=self.policy.handshake_timeout_s if context else None)
        return sock.getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """GOAWAY to every connection; calls under way get `grace_s`, then are cancelled."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.go_away()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.app.calls and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.app.cancel_all()
        await asyncio.sleep(0)  # the cancelled calls send their statuses
        for connection in list(self.connections):
            connection.close()
