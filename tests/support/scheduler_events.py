"""An EngineCore's events for one sequence as an async iterator, as the service's
GenerationStream receives them through its sink: for tests of the scheduler alone."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from gpt2serve.protocol import GenerateRequest, TokenEvent
from gpt2serve.scheduling.core import EngineCore
from gpt2serve.telemetry.records import BatchDone, StepDone


class StepRecorder:
    """An observer of the core that keeps every generation step's record and every next-token
    batch's."""

    def __init__(self):
        self.steps: list[StepDone] = []
        self.batches: list[BatchDone] = []

    def record_step(self, record: StepDone) -> None:
        self.steps.append(record)

    def record_batch(self, record: BatchDone) -> None:
        self.batches.append(record)


class QueueSink:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: TokenEvent) -> None:
        self.queue.put_nowait(event)

    def fail(self, error: Exception) -> None:
        self.queue.put_nowait(error)


async def events(batcher: EngineCore, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
    """Refusals raise at the first iteration; leaving early aborts the sequence."""
    sink = QueueSink()
    seq_id = batcher.add(request, sink)
    try:
        while True:
            event = await sink.queue.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish_reason:
                return
    finally:
        batcher.abort(seq_id)
