"""Every HTTP error answer, rendered and counted in one place, and every JSON body read one way.

REST routes answer `{"error": {"code", "message"}}`; the OpenAI-compatible routes answer OpenAI's
error object `{"error": {"message", "type", "param", "code"}}`, so the official client raises the
matching exception class. Statuses come from gpt2serve_client.status, the table both sides read.

A refusal the service has not counted (the guard's 401 / 413, bodies that are not the route's
JSON, unknown paths) is counted here, once: the service counts what reaches it (telemetry.spans
marks those errors `counted`).
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterable, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..errors import INTERNAL_MESSAGE, MalformedBody, ServeError, UnsupportedMediaType

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"  # on 429 and 503: the queue drains, or another replica takes over, within about that
B = TypeVar("B", bound=BaseModel)


class HttpErrors:
    def __init__(self, refused: Callable[..., None], method_of: Callable[[str], str],
                 openai_paths: Iterable[str]):
        """`refused(api, method, code)` counts a refusal; `method_of(path)` is its method label."""
        self.refused = refused
        self.method_of = method_of
        self.openai_paths = frozenset(openai_paths)

    def api_of(self, path: str) -> str:
        """The metrics label of the route family that answers `path`."""
        return "openai" if path in self.openai_paths else "rest"

    def body(self, path: str, error: ServeError) -> dict:
        if path in self.openai_paths:
            return {"error": {"message": error.message, "type": error.status.openai_type, "param": error.param,
                              "code": error.openai_code}}
        return {"error": {"code": error.code, "message": error.message}}

    def render(self, path: str, error: ServeError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """(status, headers, body) of the answer; counted unless the service counted it."""
        status = error.status
        http = status.openai_http if path in self.openai_paths else status.http
        if not error.counted:
            error.counted = True
            self.refused(self.api_of(path), self.method_of(path), error.code, error.message, path, http)
        body = json.dumps(self.body(path, error), separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status.retry_after:
            headers.append((b"retry-after", RETRY_AFTER_S.encode()))
        return http, headers, body

    def response(self, path: str, error: Exception) -> Response:
        http, headers, body = self.render(path, as_serve_error(error, path))
        response = Response(body, status_code=http)
        response.raw_headers = headers
        return response

    async def send(self, scope, send, error: Exception, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """The answer straight over ASGI (the guard answers before any app runs)."""
        http, headers, body = self.render(scope.get("path", ""), as_serve_error(error, scope.get("path", "")))
        await send({"type": "http.response.start", "status": http, "headers": [*headers, *extra_headers]})
        await send({"type": "http.response.body", "body": body})


def as_serve_error(error: Exception, path: str) -> ServeError:
    if isinstance(error, ServeError):
        return error
    log.error("unhandled error in %s", path, exc_info=error)
    internal = ServeError(INTERNAL_MESSAGE)
    internal.counted = getattr(error, "counted", False)
    return internal


async def read_body(request: Request, body_type: type[B]) -> B:
    """The route's JSON body, or the error that says why not (parse_body); 413 raises from the
    guard while a chunked body streams in."""
    return parse_body(await request.body(), request.headers.get("content-type"), body_type)


def parse_body(raw: bytes, content_type: str | bytes | None, body_type: type[B]) -> B:
    """`raw` read as the route's JSON body, or the error that says why not: 415 for another
    content type, 422 for invalid JSON or UTF-8, JSON nested too deep (pydantic's parser stops at
    depth 200), wrong types, missing or unknown fields."""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    if "json" not in (content_type or ""):
        raise UnsupportedMediaType("the body must be a JSON object sent with 'Content-Type: application/json'")
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        field = next((str(loc[0]) for loc in (e.get("loc", ()) for e in errors) if loc and loc[0] != "body"), None)
        raise MalformedBody(describe_validation_errors(errors), param=field) from None


def describe_validation_errors(errors: list[dict]) -> str:
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        message = ("not a field of this route: a field the server does not know is refused, never ignored"
                   if err.get("type") == "extra_forbidden" else err.get("msg", "invalid"))
        parts.append(f"{where}: {message}")
    return "; ".join(parts) or "the body is not valid for this route"
