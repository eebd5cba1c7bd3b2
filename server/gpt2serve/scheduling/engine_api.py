"""What the engine core (scheduling.core) needs of the engine: next-token forwards of prompts,
and the steps of generation. engine.engine.Engine and engine.generator.Generator are these;
tests/support/fake_engine.FakeEngine stands in for the first."""

from __future__ import annotations

from typing import Protocol, Sequence

from ..engine.engine import BatchOutput
from ..engine.generator import NewSequence, StepOutput
from ..engine.prompt_launch import PromptLaunch


class PromptEngine(Protocol):
    """What the core needs of engine.engine.Engine (tests/support/fake_engine.FakeEngine)."""

    fixed_cost_tokens: float

    def next_token(self, prompts: Sequence[Sequence[int]], top_ks: Sequence[int], traced_rows: Sequence[int] = (),
                   mapped_rows: Sequence[int] = (), last_row_rows: Sequence[int] = (),
                   scored_rows: dict[int, int] | None = None, controlled_rows: dict | None = None) -> BatchOutput: ...

    def layer_reports(self, output: BatchOutput) -> BatchOutput: ...

    # A plain batch queued without waiting for it (engine.prompt_launch); None: run it with next_token.
    def launch_prompts(self, prompts: Sequence[Sequence[int]], top_ks: Sequence[int]) -> PromptLaunch | None: ...

    def finish_prompts(self, launch: PromptLaunch) -> BatchOutput: ...


class GenerationEngine(Protocol):
    """What the core needs of engine.generator.Generator."""

    slots: int
    capacity_blocks: int
    n_ctx: int

    def remove(self, seq_ids) -> None: ...

    def prefill(self, sequences: Sequence[NewSequence]) -> StepOutput: ...

    def decode(self, riders: Sequence[Sequence[int]] = (), rider_top_ks: Sequence[int] = ()) -> StepOutput: ...

    def can_ride(self, prompt: Sequence[int]) -> bool: ...
