"""Listening sockets, bound here rather than by a server library, so port 0 yields a known
ephemeral port. With `reuse_port`, front-end processes share the port (the kernel spreads
connections).

Accepted connections inherit SO_KEEPALIVE from the listening socket: a peer that vanished without
a FIN or a reset (a host powered off, a network cut) is found by the kernel's probes once the
connection has been silent for its idle time (Linux: 2 h, the interval of gRPC's own server's
keepalive pings), so an answer that waits on its flow-control window is not held forever.
"""

from __future__ import annotations

import socket


def bind_listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
