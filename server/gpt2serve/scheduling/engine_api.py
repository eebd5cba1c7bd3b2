"""What the engine core (scheduling.core) needs of the engine: next-token forwards of prompts,
and the steps of generation. engine.engine.Engine and engine.generator.Generator are these;
tests/support/fake_engine.FakeEngine stands in for the first."""

from __future__ import annotations

from typing import Protocol, Sequence

from ..engine.engine import BatchOutput
from ..engine.generator import DecodeLaunch, NewSequence, StepOutput
from ..engine.steps import PromptAsk, PromptLaunch


class PromptEngine(Protocol):
    """What the core needs of engine.engine.Engine (tests/support/fake_engine.FakeEngine stands in
    for it), and all of it (tests/scheduling/test_engine_api.py)."""

    fixed_cost_tokens: float

    def next_token(self, asks: Sequence[PromptAsk]) -> BatchOutput: ...  # an EngineRequest is a PromptAsk

    def layer_reports(self, output: BatchOutput) -> BatchOutput: ...

    # A plain batch queued without waiting for it (engine.cuda_graphs.BucketedForward.launch); None: run it with next_token.
    def launch_prompts(self, asks: Sequence[PromptAsk]) -> PromptLaunch | None: ...

    def finish_prompts(self, launch: PromptLaunch) -> BatchOutput: ...


class GenerationEngine(Protocol):
    """What the core needs of engine.generator.Generator: all of it (tests/scheduling/test_engine_api.py
    checks that the core and its runner use nothing else)."""

    slots: int
    capacity_blocks: int
    n_ctx: int
    running: Sequence  # the sequences holding slots

    @property
    def overlaps(self) -> bool: ...  # a decode step may be launched before the last one is read

    def remove(self, seq_ids) -> None: ...

    def prefill(self, sequences: Sequence[NewSequence]) -> StepOutput: ...

    # Long prompts, read one chunk a step (engine.chunked_prefill).
    def reads_in_chunks(self, sequence: NewSequence) -> bool: ...

    def queue_chunked(self, sequence: NewSequence) -> None: ...

    @property
    def next_chunked(self) -> int | None: ...  # the sequence prefill_chunk reads next

    def prefill_chunk(self) -> StepOutput: ...

    # A decode step, launched and then read; next-token prompts, the next chunk and admitted
    # prompts may ride it (engine.step_forward), where decode steps are not CUDA graphs.
    @property
    def takes_riders(self) -> bool: ...

    def launch_decode(self, riders: Sequence[PromptAsk] = (), chunk: bool = False,
                      joining: Sequence[NewSequence] = ()) -> DecodeLaunch: ...

    def finish_decode(self, launch: DecodeLaunch) -> StepOutput: ...
