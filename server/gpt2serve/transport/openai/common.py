"""What the OpenAI-compatible routes share (vLLM's serving_engine.py): the error object, the model
check, fields refused rather than ignored, and `Choices`, the n generations of one request run
together on the service's generation streams, collected whole or interleaved as they come."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable

from fastapi import Request
from pydantic import BaseModel

from gpt2serve_client.generation import GenerateChunk, GenerateResult, Usage

from ...errors import InvalidArgument, ModelNotFound, ServeError
from ...service import GenerateSettings, InferenceService, PromptInput, RequestOptions
from ...service.generation_stream import GenerationStream
from ..http_shared import unless_disconnected
from ..sse import first_and_rest


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error object, as every OpenAI-compatible route answers errors."""
    error: OpenAIError


def check_model(asked: str, served: str) -> None:
    if asked != served:
        raise ModelNotFound(f"The model '{asked}' does not exist; this server serves '{served}'", param="model")


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice i of a seeded request draws with seed + i (as vLLM's), wrapped into 64 bits."""
    return seed if seed is None else (seed + choice + 2**63) % 2**64 - 2**63


def refuse(unsupported: Iterable[tuple[str, bool, str]]) -> None:
    """A 400 naming the first field set to something gpt2serve does not do: `(field, is_default, why)`."""
    for name, is_default, why in unsupported:
        if not is_default:
            raise InvalidArgument(f"{name}: {why or 'not supported by gpt2serve (only its default)'}", param=name)


class Choices:
    """One OpenAI request's generations (one per choice), run together in the running batch.

    A request with more choices than the KV cache has slots runs them in turns: a choice starts
    when one of this request's own ends, so none of them waits behind its siblings into a 429.
    """

    def __init__(self, service: InferenceService, inputs: list[tuple[PromptInput, GenerateSettings]],
                 options: RequestOptions, coalesce: bool = False):
        """coalesce (a streamed answer): a choice's tokens its reader has not taken yet come as one
        chunk (GenerateChunk.more_tokens), so they go out as one event."""
        self.slots = max(service.model_info().max_running_sequences, 1)
        turns = asyncio.Semaphore(self.slots)
        self.streams: list[GenerationStream] = [service.generation_stream(p, s, options) for p, s in inputs]
        self.generations = [in_turn(turns, stream.chunks(coalesce)) for stream in self.streams]

    async def results(self, request: Request) -> list[GenerateResult]:
        """Every choice to its end; the first error cancels the rest, as does a hang-up."""
        return await unless_disconnected(request, collect_all(self.generations))

    async def chunks(self, request: Request) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) as they come. The choices that start at once are awaited to their
        first chunk here, so a request's errors raise before the 200 goes out."""
        started = min(len(self.generations), self.slots)
        firsts = await unless_disconnected(request, first_chunks(self.generations[:started]))
        generations = firsts + self.generations[started:]
        return alone(generations[0]) if len(generations) == 1 else interleave(generations)


async def in_turn(turns: asyncio.Semaphore, chunks: AsyncIterator) -> AsyncIterator:
    """`chunks`, started only once a turn is free; the turn is given back at its end."""
    async with turns:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The ServeError that failed a group of generations (what the caller is told), else the first."""
    errors = group.exceptions
    return next((e for e in errors if isinstance(e, ServeError)), errors[0])


async def collect_all(generations: list[AsyncIterator]) -> list[GenerateResult]:
    """Every generation to its end, all at once (they share the running batch); the first error
    cancels the others (and so frees their slots)."""
    async def collect(chunks: AsyncIterator) -> GenerateResult:
        return GenerateResult.from_chunks([chunk async for chunk in chunks])

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(chunks)) for chunks in generations]
    except BaseExceptionGroup as failed:
        raise first_error(failed) from None
    return [task.result() for task in tasks]


async def first_chunks(generations: list[AsyncIterator]) -> list[AsyncIterator]:
    """Wait for every generation's first chunk, all at once (a request's errors raise here);
    on an error, the others are closed."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(first_and_rest(chunks)) for chunks in generations]
    except BaseExceptionGroup as failed:
        await asyncio.gather(*(chunks.aclose() for chunks in generations), return_exceptions=True)
        raise first_error(failed) from None
    return [task.result() for task in tasks]


_END = object()


async def alone(stream: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """One choice's items as (0, item): straight from its stream, with no task and queue between
    (interleave's), so a chunk wakes one task, not a pump and then the reader."""
    try:
        async for item in stream:
            yield 0, item
    finally:
        await stream.aclose()


async def interleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) as items come from any stream. An error in one ends them all: it
    raises here, and the others are cancelled (as they are when the caller stops iterating).
    The queue holds about one item a stream: a stream whose items the caller has not taken
    keeps the next ones itself, where its tokens join into one chunk (GenerationStream's
    coalescing), instead of each waiting here a chunk of its own."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _END))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def finish_reason(reason: str) -> str:
    """OpenAI has "stop" and "length"; the end-of-text token is a stop there."""
    return "stop" if reason == "eos" else reason


def usage_json(usages: list[Usage]) -> dict:
    """All choices together, as OpenAI counts them."""
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
