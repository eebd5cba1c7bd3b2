"""What the OpenAI-compatible routes share (vLLM's serving_engine.py): the error object, the model
check, fields refused rather than ignored, and `Choices`, the n generations of one request run
together on the service's generation streams, collected whole or interleaved as they come."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterable

from pydantic import BaseModel

from gpt2serve_client.generation import GenerateChunk, GenerateResult, Usage
from gpt2serve_client.types import ModelInfo

from ...errors import InvalidArgument, ModelNotFound, ServeError
from ...service import GenerateSettings, InferenceService, PromptInput, RequestOptions
from ...service.generation_stream import GenerationStream


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error object, as every OpenAI-compatible route answers errors."""
    error: OpenAIError


def check_model(asked: str, info: ModelInfo) -> str | None:
    """The LoRA adapter `model` names (vLLM's way: an adapter is a model of its own name), None for
    the base; 404 for a model this server does not serve."""
    if asked == info.model:
        return None
    if asked in info.adapters:
        return asked
    served = ", ".join([info.model, *info.adapters])
    raise ModelNotFound(f"The model '{asked}' does not exist; this server serves {served}", param="model")


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
        self.streams: list[GenerationStream] = [service.generation_stream(p, s, options) for p, s in inputs]
        self.generations: list[AsyncIterator] = [stream.chunks(coalesce) for stream in self.streams]
        if len(inputs) > self.slots:  # else every choice has its turn at once: no semaphore between
            turns = asyncio.Semaphore(self.slots)
            self.generations = [in_turn(turns, chunks) for chunks in self.generations]

    def push(self, encode: Callable[[str, list], bytes]) -> tuple | None:
        """EventStream.push for a lone choice (its token events, by `encode`, written as they
        come); None for several, whose events are interleaved."""
        return (self.streams[0].follow, encode) if len(self.streams) == 1 else None

    async def results(self) -> list[GenerateResult]:
        """Every choice to its end; the first error cancels the rest."""
        return await collect_all(self.generations)

    async def chunks(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) as they come. The choices that start at once are awaited to their
        first chunk here, so a request's errors raise before the 200 goes out."""
        started = min(len(self.generations), self.slots)
        firsts = await first_chunks(self.generations[:started])
        if len(self.generations) == 1:
            return alone(*firsts[0])
        return interleave(firsts + [(_NONE, chunks) for chunks in self.generations[started:]])


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

    if len(generations) == 1:
        return [await collect(generations[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(chunks)) for chunks in generations]
    except BaseExceptionGroup as failed:
        raise first_error(failed) from None
    return [task.result() for task in tasks]


_NONE = object()  # no first item taken yet
_END = object()


async def first_chunks(generations: list[AsyncIterator]) -> list[tuple[Any, AsyncIterator]]:
    """Each generation's first chunk, and the generation; waited for all at once (a request's
    errors raise here); on an error, the others are closed."""
    if len(generations) == 1:  # no task between: the first chunk is awaited here
        return [(await anext(generations[0]), generations[0])]
    async def first(chunks: AsyncIterator) -> Any:
        return await anext(chunks)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(first(chunks)) for chunks in generations]
    except BaseExceptionGroup as failed:
        await asyncio.gather(*(chunks.aclose() for chunks in generations), return_exceptions=True)
        raise first_error(failed) from None
    return [(task.result(), chunks) for task, chunks in zip(tasks, generations)]


async def alone(first: Any, stream: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """One choice's items as (0, item), its first already taken: straight from its stream, with
    no task and queue between (interleave's), so a chunk wakes one task, not a pump and then
    the reader."""
    try:
        yield 0, first
        async for item in stream:
            yield 0, item
    finally:
        await stream.aclose()


async def interleave(streams: list[tuple[Any, AsyncIterator]]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) as items come from any stream (each given with its first item, or
    _NONE). An error in one ends them all: it raises here, and the others are cancelled (as they
    are when the caller stops iterating). The queue holds about one item a stream: a stream
    whose items the caller has not taken keeps the next ones itself, where its tokens join into
    one chunk (GenerationStream's coalescing), instead of each waiting here a chunk of its own."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, first: Any, stream: AsyncIterator) -> None:
        try:
            if first is not _NONE:
                await queue.put((index, first))
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _END))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(index, first, stream)) for index, (first, stream) in enumerate(streams)]
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
