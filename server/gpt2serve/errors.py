"""Errors the service raises, each with its gRPC status name and HTTP status.

Transports map these to wire status codes; nothing below transport knows about either protocol.
"""

from __future__ import annotations

# What a caller is told of a failure that is not theirs (the details go to the server log).
INTERNAL_MESSAGE = "internal error; see server log"


class ServeError(Exception):
    code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(ServeError):
    code = "INVALID_ARGUMENT"
    http_status = 400


class FailedPrecondition(ServeError):
    code = "FAILED_PRECONDITION"
    http_status = 400


class ResourceExhausted(ServeError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 429


class PayloadTooLarge(ServeError):
    code = "RESOURCE_EXHAUSTED"  # what grpc itself answers for an oversized message
    http_status = 413


class Unauthenticated(ServeError):
    code = "UNAUTHENTICATED"
    http_status = 401


class Unavailable(ServeError):
    code = "UNAVAILABLE"
    http_status = 503


class ShuttingDown(Unavailable):
    """Refused because this server is draining: retry elsewhere, not here (gRPC tells retry
    policies so with a negative grpc-retry-pushback-ms)."""


class NonFiniteOutput(ServeError):
    """The model's logits for one row were not finite (a numerical overflow): that row fails
    alone, with INTERNAL, and the rest of its batch is answered."""


class DeadlineExceeded(ServeError):
    code = "DEADLINE_EXCEEDED"
    http_status = 504


def error_from_code(code: str, message: str) -> ServeError:
    """The error a (code, message) pair stands for, as it crossed a process boundary."""
    for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unauthenticated, Unavailable,
                DeadlineExceeded):
        if cls.code == code:
            return cls(message)
    return ServeError(message)


class ModelLoadError(Exception):
    """The requested weights could not be loaded (bad path, unreachable hub, not GPT-2)."""
