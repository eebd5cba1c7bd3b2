"""A generator (scheduling.engine_api.ModelRunner) for in-process scheduling tests of
next-token batches: no model and no cache slots, answers computed from the prompt, and a forward
that takes `forward_s` (in the engine thread, as the real one does)."""

from __future__ import annotations

import time

from gpt2serve.engine.engine import OutOfMemory
from gpt2serve.engine.steps import BatchOutput, StepLaunch, StepOutput, StepPlan
from gpt2serve.protocol import TokenScore


class FakeGenerator:
    slots, capacity_blocks, n_ctx, running = 0, 0, 1024, ()
    fixed_cost_tokens = 32.0
    overlaps = takes_riders = False
    next_chunk = None

    def __init__(self, forward_s: float = 0.01, oom_above: int | None = None):
        self.forward_s = forward_s
        self.oom_above = oom_above  # batches larger than this raise OutOfMemory
        self.batch_sizes: list[int] = []

    def launch(self, plan: StepPlan) -> StepLaunch:
        """A next-token batch (riders alone: with no slots, nothing else is ever planned), run whole."""
        assert not (plan.decode or plan.joining or plan.chunk), plan
        prompts, top_ks = [a.prompt for a in plan.riders], [a.top_k for a in plan.riders]
        if self.oom_above is not None and len(prompts) > self.oom_above:
            raise OutOfMemory(f"fake: {len(prompts)} > {self.oom_above}")
        self.batch_sizes.append(len(prompts))
        started, started_ns = time.perf_counter(), time.time_ns()
        time.sleep(self.forward_s)
        # The "next token" is the sum of the prompt's ids: easy to check, different per prompt.
        top = [[TokenScore(sum(p) + rank, -float(rank)) for rank in range(k)] for p, k in zip(prompts, top_ks)]
        output = BatchOutput(top, time.perf_counter() - started, max(map(len, prompts)), started_ns, time.time_ns())
        return StepLaunch([], None, None, None, sum(map(len, prompts)), started, started_ns, prompts=output)

    def finish(self, launch: StepLaunch) -> StepOutput:
        out = launch.prompts
        return StepOutput({}, "next-token", len(out.top), launch.tokens_in, out.forward_s, out.started_ns,
                          out.ended_ns, riders=out)

    def layer_reports(self, output: BatchOutput) -> BatchOutput:
        return output

    def remove(self, seq_ids) -> None:
        pass

    def uncached_tokens(self, prompt, adapter=None) -> int:
        return len(prompt)

    def chunk_if_long(self, sequence) -> bool:
        return False
