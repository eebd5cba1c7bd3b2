"""Waiting for a server that is starting, for every client: a refused connection (the port is not
open yet) and "the model is still loading" (UNAVAILABLE / 503 with a retry-after) are tried again,
with backoff and after the server's retry-after, until the call's deadline. Then the error says
the server did not become ready in time, and why (the last refusal)."""

from __future__ import annotations

import random
import time

from .errors import Gpt2ServeError

FIRST_WAIT_S = 0.05
MAX_WAIT_S = 1.0  # a server that becomes ready is seen within about this long
# What grpcio says when nothing listens yet (the port is closed, or the name does not resolve yet);
# not a failed TLS handshake, which waiting does not mend.
GRPC_CONNECT_FAILURES = ("connection refused", "dns resolution failed")


def grpc_connect_failed(details: str) -> bool:
    details = details.lower()
    return any(text in details for text in GRPC_CONNECT_FAILURES)


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After (or retry-after metadata) in seconds; None when absent or not a number."""
    try:
        return float(value) if value else None
    except ValueError:
        return None


class ServerStarting:
    """One call's waits for a starting server; `target` names it in the error."""

    def __init__(self, target: str, timeout: float | None):
        self.target, self.timeout = target, timeout
        self.started_at = time.monotonic()
        self.deadline = None if timeout is None else self.started_at + timeout
        self.reason: str | None = None  # the last "not ready" seen
        self.waits = 0

    def wait_s(self, reason: str, retry_after: float | None = None, http_status: int | None = None) -> float:
        """Seconds to wait before trying again; when the deadline leaves no room for another try,
        the error (`http_status`: the last answer's, REST) is raised instead."""
        self.reason = reason
        wait = min(FIRST_WAIT_S * 2 ** self.waits, MAX_WAIT_S) * random.uniform(0.75, 1.0)
        if retry_after is not None:
            wait = max(wait, min(retry_after, MAX_WAIT_S))  # honoured, capped so readiness is seen soon
        self.waits += 1
        if self.deadline is not None and time.monotonic() + wait >= self.deadline:
            raise self.error(http_status) from None
        return wait

    def error(self, http_status: int | None = None) -> Gpt2ServeError:
        """`http_status`: the last answer's (REST), when the server answered."""
        waited = time.monotonic() - self.started_at
        within = f"within {self.timeout:g} s" if self.timeout is not None else f"after {waited:.1f} s"
        return Gpt2ServeError("UNAVAILABLE", f"the server at {self.target} did not become ready {within} "
                                             f"(last: {self.reason}); raise the timeout or check the server's log",
                              http_status=http_status)
