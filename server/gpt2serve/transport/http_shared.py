"""What the REST and OpenAI routes share: how a request arrived (for spans and metrics), and
whether its client hangs up while it waits."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Iterable, TypeVar

from fastapi import Request

from ..service import RequestOptions
from ..telemetry.tracing import propagated_fields
from .http_direct import CallHead

T = TypeVar("T")


def call_options(head: CallHead, route: str, method: str, api: str = "rest", attributes: dict | None = None,
                 **asked: bool) -> RequestOptions:
    """Span name and attributes (the route's own `attributes` too), the caller's W3C trace context
    (headers), and what it asked to see (`asked`: trace_layers, include_layers, attention_maps)."""
    return RequestOptions(
        api=api, method=method, span_name=f"POST {route}", trace_carrier=trace_carrier(head.headers),
        attributes={"http.request.method": "POST", "http.route": route, "url.scheme": head.scheme,
                    **(attributes or {})}, **asked)


_header_fields: tuple[frozenset[str], frozenset[bytes]] = (frozenset(), frozenset())  # propagated_fields(), as bytes


def trace_carrier(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The trace context fields among the caller's headers (telemetry.tracing.propagated_fields);
    None when it sent none, the common case."""
    global _header_fields
    fields = propagated_fields()
    if _header_fields[0] is not fields:
        _header_fields = (fields, frozenset(field.encode("latin-1") for field in fields))
    wanted = _header_fields[1]
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in headers if name in wanted} or None


class ClientDisconnected(Exception):
    """Nobody is left to answer."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client hangs up, so its prompts leave the queue
    instead of reaching the model (Starlette does not cancel a handler on disconnect). The work
    runs in the caller's task and one watcher cancels that task: a task of its own for the work
    and an asyncio.wait over both cost more than the rest of a REST call's routing."""
    caller = asyncio.current_task()
    hung_up = False

    async def hang_up() -> None:
        nonlocal hung_up
        while (await request.receive())["type"] != "http.disconnect":
            pass
        hung_up = True
        caller.cancel()

    watcher = asyncio.get_running_loop().create_task(hang_up())
    try:
        return await work
    except asyncio.CancelledError:
        if not hung_up:
            raise  # cancelled from outside (a drain, a shutdown): theirs to handle
        caller.uncancel()  # the cancel was ours, turned into this:
        raise ClientDisconnected() from None
    finally:
        watcher.cancel()
