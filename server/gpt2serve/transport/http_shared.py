"""What the REST and OpenAI routes share: how a request arrived (for spans and metrics), and
whether its client hangs up while it waits."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request
from opentelemetry import propagate

from ..service import RequestOptions

T = TypeVar("T")
def http_options(request: Request, route: str, method: str, api: str = "rest", attributes: dict | None = None,
                 **asked: bool) -> RequestOptions:
    """Span name and attributes (the route's own `attributes` too), the caller's W3C trace context
    (headers), and what it asked to see (`asked`: trace_layers, include_layers, attention_maps)."""
    return RequestOptions(
        api=api, method=method, span_name=f"POST {route}", parent=propagate.extract(request.headers),
        attributes={"http.request.method": "POST", "http.route": route, "url.scheme": request.url.scheme,
                    **(attributes or {})}, **asked)


class ClientDisconnected(Exception):
    """Nobody is left to answer."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client hangs up, so its prompts leave the queue
    instead of reaching the model (Starlette does not cancel a handler on disconnect)."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
