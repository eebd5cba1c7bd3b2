"""Noticing an HTTP client that hangs up while its request waits (REST and OpenAI routes)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request

T = TypeVar("T")


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
