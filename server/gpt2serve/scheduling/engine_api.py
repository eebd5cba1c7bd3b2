"""What the engine core (scheduling.core) needs of the engine: next-token forwards of prompts,
and the steps of generation. engine.engine.Engine and engine.generator.Generator are these;
tests/support/fake_engine.FakeEngine stands in for the first."""

from __future__ import annotations

from typing import Protocol, Sequence

from ..engine.steps import BatchOutput, NewSequence, PromptAsk, PromptLaunch, StepLaunch, StepOutput, StepPlan


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
    checks that the core and its runner use nothing else). A step is a plan (engine.steps.StepPlan)
    launched, then read: decode rows, next-token prompts riding along, joining prompts, a chunk."""

    slots: int
    capacity_blocks: int
    n_ctx: int
    running: Sequence  # the sequences holding slots

    @property
    def overlaps(self) -> bool: ...  # a step may be launched before the last one is read

    @property
    def takes_riders(self) -> bool: ...  # prompts may share decode rows' forward (not where steps are CUDA graphs)

    def remove(self, seq_ids) -> None: ...

    def uncached_tokens(self, prompt) -> int: ...  # what reading it computes, past the prefix cache's blocks

    # Long prompts, read one chunk a step (engine.chunked_prefill): queued here, not joining.
    def chunk_if_long(self, sequence: NewSequence) -> bool: ...

    @property
    def next_chunk(self) -> tuple[int, int] | None: ...  # (the sequence StepPlan.chunk reads next, its tokens at most)

    def launch(self, plan: StepPlan) -> StepLaunch: ...

    def finish(self, launch: StepLaunch) -> StepOutput: ...
