"""Every error status gpt2serve answers, in one table that the server and the clients both read.

A row is one kind of failure: its gRPC status name (also the `code` of a REST error body), its
HTTP status on the REST routes and on the OpenAI-compatible ones (OpenAI answers 400 where REST
says 415 or 422), OpenAI's error `type`, and whether the answer says Retry-After. docs/api.md's
error table is generated from it (scripts/gen_docs.py) and the OpenAPI document checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorStatus:
    kind: str  # the server's name for the failure
    code: str  # gRPC status name; the REST body's "code"
    http: int
    openai_http: int
    openai_type: str
    retry_after: bool  # 429 and 503: the client should come back (REST: Retry-After, gRPC: pushback)
    when: str  # one line for the documentation


ERROR_STATUSES: tuple[ErrorStatus, ...] = (
    ErrorStatus("invalid_argument", "INVALID_ARGUMENT", 400, 400, "invalid_request_error", False,
                "a value the server cannot serve: empty prompt, too many tokens, ids outside the vocabulary, "
                "top_k out of range, prompt + max_tokens past the context, too many prompts"),
    ErrorStatus("failed_precondition", "FAILED_PRECONDITION", 400, 400, "invalid_request_error", False,
                "switched off on this server (per-layer reports with --trace-layers never; chat with no template)"),
    ErrorStatus("unauthenticated", "UNAUTHENTICATED", 401, 401, "authentication_error", False,
                "API key missing or wrong"),
    ErrorStatus("not_found", "NOT_FOUND", 404, 404, "not_found_error", False,
                "no such path, or (OpenAI routes) no such model"),
    ErrorStatus("method_not_allowed", "UNIMPLEMENTED", 405, 405, "invalid_request_error", False,
                "the path exists, the HTTP method does not"),
    ErrorStatus("payload_too_large", "RESOURCE_EXHAUSTED", 413, 413, "invalid_request_error", False,
                "the body exceeds --max-message-bytes (by Content-Length, or counted as a chunked body arrives)"),
    ErrorStatus("unsupported_media_type", "INVALID_ARGUMENT", 415, 400, "invalid_request_error", False,
                "the body is not sent as Content-Type: application/json"),
    ErrorStatus("malformed", "INVALID_ARGUMENT", 422, 400, "invalid_request_error", False,
                "the body is not the route's JSON: invalid JSON or UTF-8, nested too deep, wrong types, "
                "missing or unknown fields"),
    ErrorStatus("resource_exhausted", "RESOURCE_EXHAUSTED", 429, 429, "rate_limit_error", True,
                "busy now: the queue is full, or no room in the KV cache came free in time"),
    ErrorStatus("cancelled", "CANCELLED", 499, 499, "server_error", False,
                "the caller hung up (counted, never read)"),
    ErrorStatus("internal", "INTERNAL", 500, 500, "server_error", False,
                "a failure of the server's own (details in its log, never in the answer)"),
    ErrorStatus("unavailable", "UNAVAILABLE", 503, 503, "service_unavailable", True,
                "loading, shutting down, or the engine process is gone"),
    ErrorStatus("deadline_exceeded", "DEADLINE_EXCEEDED", 504, 504, "timeout", False,
                "the caller's deadline passed first"),
)
BY_KIND = {status.kind: status for status in ERROR_STATUSES}


def code_for_http(http_status: int) -> str:
    """The code an HTTP error status stands for (the first row with it), for bodies without one."""
    for status in ERROR_STATUSES:
        if status.http == http_status or status.openai_http == http_status:
            return status.code
    return "UNKNOWN"
