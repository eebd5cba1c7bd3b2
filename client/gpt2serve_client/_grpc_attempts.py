"""A gRPC call's attempts (grpc_client.Client and AsyncClient): a stream the server refused
unopened is sent again, a call that met an unavailable replica fails over, and a server that is
starting is waited for (_starting.py), all within the call's deadline; and the one error a call
raises, whatever gRPC said."""

from __future__ import annotations

import random
import time

import grpc

from ._starting import ServerStarting, grpc_connect_failed, retry_after_s
from .errors import Gpt2ServeError

# A stream the server refused unopened (RST_STREAM REFUSED_STREAM, HTTP/2 error code 7: past its
# concurrent streams on a connection whose SETTINGS had not yet reached us, or were counted
# apart): the server never saw the call (RFC 9113 §8.7), so it is sent again whatever the retry
# policy, after a short wait, within the call's deadline. gRPC's own transparent retry does not
# catch every case of it (300 calls at once on a fresh channel met 32 such UNAVAILABLEs).
REFUSED_STREAM_RETRIES = 50


def _refused_stream(exc: grpc.RpcError) -> bool:
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in details and "error code 7" in details


def _refused_wait_s(refused: int) -> float:
    """Waits of 2, 4, 8 ... up to 100 ms, jittered, before a refused stream is sent again."""
    return min(0.002 * 2 ** refused, 0.1) * random.uniform(0.5, 1.0)


def _not_ready(exc: grpc.RpcError) -> tuple[str, float | None] | None:
    """(why, the server's retry-after) when the call met a server not ready yet: its port closed,
    or its model still loading (UNAVAILABLE with retry-after); None for any other error."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = exc.details() or ""
    if grpc_connect_failed(details):
        return f"could not connect: {details}", None
    retry_after = next((retry_after_s(v) for k, v in (exc.trailing_metadata() or ()) if k == "retry-after"), None)
    return (details, retry_after) if retry_after is not None else None


class Attempts:
    """One call's attempts: the retries its policy allows on UNAVAILABLE (a failover), refused
    streams sent again (see REFUSED_STREAM_RETRIES), and, with `starting`, the waits for a server
    that is starting (_starting.py), all within its deadline."""

    def __init__(self, failovers: int, timeout: float | None, starting: ServerStarting | None = None):
        self.failovers, self.refused, self.starting = failovers, 0, starting
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_for_ready = False  # once a connection failed: gRPC holds the next attempt until it connects

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def again(self, exc: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt, or None: raise this error."""
        if _refused_stream(exc) and self.refused < REFUSED_STREAM_RETRIES:
            self.refused += 1
            wait = _refused_wait_s(self.refused)
            left = self.timeout()
            if left is None or left > wait:
                return wait
        if self.starting is not None and (not_ready := _not_ready(exc)) is not None:
            why, retry_after = not_ready
            wait = self.starting.wait_s(why, retry_after)
            if retry_after is None:  # not connected: the channel's own reconnection is the wait
                self.wait_for_ready, wait = True, 0.0
            return wait
        if self.wait_for_ready and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise self.starting.error() from None  # the deadline passed while it waited to connect
        if error_of(exc).code == "UNAVAILABLE" and self.failovers > 1:
            self.failovers -= 1
            return 0.0
        return None

    def wait_or_raise(self, exc: grpc.RpcError, resend: bool = True) -> float:
        """Seconds to wait before sending again; the call's error raised where it is not sent
        again (resend=False: never, e.g. a stream that has already given a token)."""
        wait = self.again(exc) if resend else None
        if wait is None:
            raise error_of(exc) from None
        return wait


def error_of(exc: grpc.RpcError) -> Gpt2ServeError:
    if exc.code() == grpc.StatusCode.CANCELLED:
        # Our callers cancel by cancelling their task (CancelledError), never through a status:
        # a CANCELLED status comes from the other side, e.g. a retry that met a closing server.
        # Callers should fail over, as for any unavailable server.
        return Gpt2ServeError("UNAVAILABLE", f"the server cancelled the call: {exc.details() or 'no details'}")
    return Gpt2ServeError(exc.code().name, exc.details() or "")
