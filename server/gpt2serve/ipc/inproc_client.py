"""`--workers 1`: the engine client as plain calls on this process's engine core, as vLLM's
InprocClient is for its engine core. Nothing is encoded; the messages are the same dataclasses
(protocol) that cross the IPC wire under `--workers N`."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Callable

from ..protocol import GenerateRequest, NextTokenOutput, NextTokenRequest, TokenSink

if TYPE_CHECKING:
    from ..scheduling.core import EngineCore


class InprocEngineClient:
    def __init__(self, core: EngineCore):
        self._core = core
        self.max_batch_size = core.max_batch_size

    async def next_token(self, request: NextTokenRequest) -> list[NextTokenOutput]:
        return await self._core.submit(request.prompts, request.top_k, request.trace, request.prompt_logprobs,
                                       request.controls, request.adapter)

    async def update_adapter(self, name: str, path: str | None) -> list[str]:
        return await asyncio.to_thread(self._core.update_adapter, name, path)

    def generate(self, request: GenerateRequest, sink: TokenSink) -> Callable[[], None]:
        return functools.partial(self._core.abort, self._core.add(request, sink))
