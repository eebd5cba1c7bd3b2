"""Listening sockets, bound here rather than by a server library, so port 0 yields a known
ephemeral port. With `reuse_port`, front-end processes share the port (the kernel spreads
connections).

Accepted connections inherit SO_KEEPALIVE from the listening socket: a peer that vanished without
a FIN or a reset (a host powered off, a network cut) is found by the kernel's probes once the
connection has been silent for its idle time (Linux: 2 h, the interval of gRPC's own server's
keepalive pings), so an answer that waits on its flow-control window is not held forever.
"""

from __future__ import annotations

import errno
import socket

from ..errors import StartupError


def bind_listening_socket(host: str, port: int, reuse_port: bool = False, flag: str = "the port") -> socket.socket:
    """`flag`: the option that sets `port`, named in the error when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is in use by another process: choose another with {flag} "
                               "(0 picks a free one)") from exc
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror} (--host, {flag})") from exc
    sock.set_inheritable(True)
    return sock
