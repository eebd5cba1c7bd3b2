"""Errors the service raises, each a kind of failure in gpt2serve_client.status's table.

Transports map these to wire statuses through that table; nothing below transport knows either
protocol.
"""

from __future__ import annotations

from gpt2serve_client.status import BY_KIND, ErrorStatus

# What a caller is told of a failure that is not theirs (the details go to the server log).
INTERNAL_MESSAGE = "internal error; see server log"


class ServeError(Exception):
    kind = "internal"
    counted = False  # set once a request metric has counted it (see telemetry.spans, transport)
    openai_code = None  # OpenAI's error `code`, where it has one for this failure

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI's error `param`)

    @property
    def status(self) -> ErrorStatus:
        return BY_KIND[self.kind]

    @property
    def code(self) -> str:
        return self.status.code

    @property
    def http_status(self) -> int:
        return self.status.http


class InvalidArgument(ServeError):
    kind = "invalid_argument"


class FailedPrecondition(ServeError):
    kind = "failed_precondition"


class NotFound(ServeError):
    kind = "not_found"


class ModelNotFound(NotFound):
    openai_code = "model_not_found"


class MethodNotAllowed(ServeError):
    kind = "method_not_allowed"


class MalformedBody(ServeError):
    """The body is not the route's JSON (syntax, UTF-8, depth, types, fields)."""
    kind = "malformed"


class UnsupportedMediaType(ServeError):
    kind = "unsupported_media_type"


class ResourceExhausted(ServeError):
    kind = "resource_exhausted"


class PayloadTooLarge(ServeError):
    kind = "payload_too_large"  # RESOURCE_EXHAUSTED: what grpc itself answers for an oversized message


class Unauthenticated(ServeError):
    kind = "unauthenticated"


class Unavailable(ServeError):
    kind = "unavailable"


class ModelLoading(Unavailable):
    """Refused because the model is not loaded yet: clients wait and try again (REST: Retry-After;
    gRPC: retry-after metadata), which ours do within their deadline."""


class ShuttingDown(Unavailable):
    """Refused because this server is draining: retry elsewhere, not here (gRPC tells retry
    policies so with a negative grpc-retry-pushback-ms)."""


class NonFiniteOutput(ServeError):
    """The model's logits for one row were not finite (a numerical overflow): that row fails
    alone, with INTERNAL, and the rest of its batch is answered."""


class DeadlineExceeded(ServeError):
    kind = "deadline_exceeded"


def error_from_code(code: str, message: str) -> ServeError:
    """The error a (code, message) pair stands for, as it crossed a process boundary."""
    for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unauthenticated, Unavailable,
                DeadlineExceeded, NotFound):
        if BY_KIND[cls.kind].code == code:
            return cls(message)
    return ServeError(message)


class StartupError(Exception):
    """The server cannot start, for a reason its message names with the flag that changes it
    (printed as one line; `--log-level debug` also logs the traceback)."""


class ModelLoadError(Exception):
    """The requested weights could not be loaded (bad path, unreachable hub, not GPT-2)."""
