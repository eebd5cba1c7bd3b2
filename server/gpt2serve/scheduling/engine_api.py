"""What the engine core (scheduling.core) needs of the engine: steps, each a plan of rows
(engine.steps.StepPlan) launched and then read. engine.generator.Generator is this;
tests/support/fake_generator.FakeGenerator stands in for it where no model is needed."""

from __future__ import annotations

from typing import Protocol, Sequence

from ..engine.steps import BatchOutput, NewSequence, StepLaunch, StepOutput, StepPlan


class ModelRunner(Protocol):
    """All the core needs of engine.generator.Generator (tests/scheduling/test_engine_api.py checks
    that the core and its runner use nothing else). A step's plan holds decode rows, next-token
    prompts (riding them, or alone: a next-token batch), joining prompts and a chunk."""

    slots: int
    capacity_blocks: int
    n_ctx: int
    running: Sequence  # the sequences holding slots

    @property
    def fixed_cost_tokens(self) -> float: ...  # a forward's fixed cost, for grouping prompts by length

    @property
    def overlaps(self) -> bool: ...  # a step may be launched before the last one is read

    @property
    def takes_riders(self) -> bool: ...  # prompts may share decode rows' forward (not where steps are CUDA graphs)

    def remove(self, seq_ids) -> None: ...

    def uncached_tokens(self, prompt, adapter=None) -> int: ...  # what reading it computes, past the prefix cache's blocks

    # Long prompts, read one chunk a step (engine.chunked_prefill): queued here, not joining.
    def chunk_if_long(self, sequence: NewSequence) -> bool: ...

    @property
    def next_chunk(self) -> tuple[int, int] | None: ...  # (the sequence StepPlan.chunk reads next, its tokens at most)

    def launch(self, plan: StepPlan) -> StepLaunch: ...

    def finish(self, launch: StepLaunch) -> StepOutput: ...

    def layer_reports(self, output: BatchOutput) -> BatchOutput: ...  # a traced batch's, after its answers went out
