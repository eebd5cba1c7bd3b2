"""Server-sent events, shared by the REST and OpenAI streams."""

from __future__ import annotations

import json
from typing import AsyncIterator, TypeVar

T = TypeVar("T")


def sse_event(payload: dict | str, event: str | None = None) -> bytes:
    """One event: `data:` a JSON object (or a bare string such as OpenAI's [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"{f'event: {event}' + chr(10) if event else ''}data: {data}\n\n".encode()


async def first_and_rest(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the stream's first item, so that a request's errors raise before a 200 goes out;
    returns an iterator over all items, that one first."""
    first = await anext(items)

    async def everything() -> AsyncIterator[T]:
        yield first
        async for item in items:
            yield item

    return everything()
