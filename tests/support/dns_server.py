"""A real DNS server on loopback (dnslib, UDP and TCP on an ephemeral port) whose A records a
test sets and changes: what a Kubernetes headless Service is to gRPC clients, one address per
ready replica. Names it does not know get NXDOMAIN; other record types get an empty answer."""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class _Records(BaseResolver):
    def __init__(self):
        self.lock = threading.Lock()
        self.addresses: dict[str, list[str]] = {}

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            addresses = self.addresses.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


class LoopbackDns:
    def __init__(self):
        self._records = _Records()
        quiet = DNSLogger(log="-request,-reply,-truncated,-error", prefix=False)
        self._udp = DNSServer(self._records, address="127.0.0.1", port=0, logger=quiet)
        self.port = self._udp.server.server_address[1]
        self._tcp = DNSServer(self._records, address="127.0.0.1", port=self.port, tcp=True, logger=quiet)

    def set(self, name: str, addresses: list[str]) -> None:
        with self._records.lock:
            self._records.addresses[name] = list(addresses)

    def target(self, name: str, port: int) -> str:
        """A gRPC target that resolves `name` with this server (c-ares: GRPC_DNS_RESOLVER=ares)."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def __enter__(self) -> LoopbackDns:
        self._udp.start_thread()
        self._tcp.start_thread()
        return self

    def __exit__(self, *exc) -> None:
        self._udp.stop()
        self._tcp.stop()
