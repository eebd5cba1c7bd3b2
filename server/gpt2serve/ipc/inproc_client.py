"""`--workers 1`: the engine client as plain calls on this process's schedulers, as vLLM's
InprocClient is for its engine core. Nothing is encoded; the messages are the same dataclasses
(protocol) that cross the IPC wire under `--workers N`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from ..protocol import GenerateRequest, NextTokenOutput, NextTokenRequest, TokenSink

if TYPE_CHECKING:
    from ..scheduling.batcher import Batcher
    from ..scheduling.continuous_batcher import ContinuousBatcher


class InprocEngineClient:
    def __init__(self, batcher: Batcher, continuous: ContinuousBatcher):
        self._batcher = batcher
        self._continuous = continuous
        self.max_batch_size = batcher.max_batch_size

    async def next_token(self, request: NextTokenRequest) -> list[NextTokenOutput]:
        return await self._batcher.submit(request.prompts, request.top_k, request.trace,
                                                    request.prompt_logprobs)

    def generate(self, request: GenerateRequest, sink: TokenSink) -> Callable[[], None]:
        return functools.partial(self._continuous.abort, self._continuous.add(request, sink))
