"""An engine for in-process scheduling tests: no model, answers computed from the prompt, and a
forward that takes `forward_s` (in the engine thread, as the real one does)."""

from __future__ import annotations

import time
from typing import Sequence

from gpt2serve.engine.engine import OutOfMemory
from gpt2serve.engine.steps import BatchOutput
from gpt2serve.engine.steps import PromptAsk
from gpt2serve.protocol import TokenScore


class FakeEngine:
    fixed_cost_tokens = 32.0

    def __init__(self, forward_s: float = 0.01, oom_above: int | None = None):
        self.forward_s = forward_s
        self.oom_above = oom_above  # batches larger than this raise OutOfMemory
        self.batch_sizes: list[int] = []

    def next_token(self, asks: Sequence[PromptAsk]) -> BatchOutput:
        prompts, top_ks = [a.prompt for a in asks], [a.top_k for a in asks]
        if self.oom_above is not None and len(prompts) > self.oom_above:
            raise OutOfMemory(f"fake: {len(prompts)} > {self.oom_above}")
        self.batch_sizes.append(len(prompts))
        started, started_ns = time.perf_counter(), time.time_ns()
        time.sleep(self.forward_s)
        # The "next token" is the sum of the prompt's ids: easy to check, different per prompt.
        top = [[TokenScore(sum(p) + rank, -float(rank)) for rank in range(k)] for p, k in zip(prompts, top_ks)]
        return BatchOutput(top, time.perf_counter() - started, max(map(len, prompts)), started_ns, time.time_ns())

    def layer_reports(self, output: BatchOutput) -> BatchOutput:
        return output

    def launch_prompts(self, asks: Sequence[PromptAsk]) -> None:
        return None  # no graphs: every batch runs whole (next_token)

    def finish_prompts(self, launch) -> BatchOutput:
        raise AssertionError("nothing was launched")
