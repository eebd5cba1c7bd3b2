"""One exception type for every failed call, whatever the transport."""

from __future__ import annotations


class Gpt2ServeError(Exception):
    """A call failed. `code` is the gRPC status name ("INVALID_ARGUMENT", "UNAVAILABLE", ...);
    `http_status` is set for REST calls."""

    def __init__(self, code: str, message: str, http_status: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.http_status = http_status
