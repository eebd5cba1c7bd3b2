"""Batched next-token forward passes over a loaded GPT-2.

Prompts of different lengths share one forward: they are left-padded so every prompt's last
token sits in the last column, with an attention mask that hides the padding and position ids
that start at 0 at each prompt's first real token. Only the last position goes through the LM
head, so a prompt in a batch gets the same answer it gets alone.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from gpt2serve_client.types import LayerReport

from ..introspection.probe import ForwardTimeline, LayerProbe
from .loading import LoadedModel


# A forward's cost that does not grow with the batch, in padded tokens' worth (see warm_up).
DEFAULT_FIXED_COST_TOKENS = 32.0
MAX_FIXED_COST_TOKENS = 4096.0
SLOW_GEMM_ROWS = (4, 16)  # see Engine.unembed


class OutOfMemory(Exception):
    """The device ran out of memory for this batch; the cached blocks were released, so a
    smaller batch may fit (the scheduler splits and retries)."""


def oom_as_out_of_memory(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None

    return wrapper


@dataclass(frozen=True)
class TokenScore:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class BatchOutput:
    top: list[list[TokenScore]]  # per prompt, most likely first
    forward_s: float
    padded_len: int
    started_ns: int  # wall clock (time.time_ns) of the forward
    ended_ns: int
    layers: dict[int, list[LayerReport]] = field(default_factory=dict)  # traced row -> one report per block
    timeline: ForwardTimeline | None = None  # stage times, when any row was traced
    probe: LayerProbe | None = None  # set until Engine.layer_reports() has turned it into `layers`


class Engine:
    """Owns the model. Not thread-safe: one worker thread calls it (see scheduling)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.pad_token_id = loaded.tokenizer.eos_token_id or 0
        self.fixed_cost_tokens = DEFAULT_FIXED_COST_TOKENS  # Refined by warm_up().

    def warm_up(self) -> None:
        """Pay for first-forward allocations and kernel choice before the server says ready, and
        measure `fixed_cost_tokens`: a forward costs about fixed + c * padded tokens, and the
        scheduler's length grouping needs fixed / c (large on a GPU, tens of tokens on a CPU)."""
        small, large = (1, 8), (8, 16)  # (prompts, tokens each)

        def best_of_3(shape: tuple[int, int]) -> float:
            batch = [[self.pad_token_id] * shape[1]] * shape[0]
            return min(self.next_token(batch, [1] * shape[0]).forward_s for _ in range(3))

        t_small, t_large = best_of_3(small), best_of_3(large)
        per_token = (t_large - t_small) / (large[0] * large[1] - small[0] * small[1])
        fixed = t_small - small[0] * small[1] * per_token
        if per_token > 0 and fixed > 0:
            self.fixed_cost_tokens = min(max(fixed / per_token, 1.0), MAX_FIXED_COST_TOKENS)
        else:  # Timing noise, or the device is far from saturated: padding is nearly free.
            self.fixed_cost_tokens = MAX_FIXED_COST_TOKENS

    @oom_as_out_of_memory
    @torch.inference_mode()
    def next_token(self, prompts: Sequence[Sequence[int]], top_ks: Sequence[int],
                   traced_rows: Sequence[int] = ()) -> BatchOutput:
        """`traced_rows`: indices of prompts whose per-layer reports are wanted (see introspection)."""
        started, started_ns = time.perf_counter(), time.time_ns()
        input_ids, attention_mask, position_ids = self.left_pad(prompts)
        probe = None
        if traced_rows:
            probe = LayerProbe(self.model, traced_rows, [len(prompts[r]) for r in traced_rows], input_ids,
                               self.loaded.tokenizer.token_text)
        with probe.attached() if probe else nullcontext():
            hidden = self.model.transformer(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state  # (B, T, d_model)
        logits = self.unembed(hidden[:, -1, :])  # (B, vocab): only the last position is decoded
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, vocab), fp32 whatever the model dtype
        top_values, top_ids = torch.topk(logprobs, k=max(top_ks), dim=-1)  # (B, k_max)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()  # one device->host copy
        top = [
            [TokenScore(i, v) for i, v in zip(ids[:k], values[:k])]
            for ids, values, k in zip(top_ids, top_values, top_ks)
        ]
        if probe:
            probe.finish()
        return BatchOutput(top, time.perf_counter() - started, input_ids.shape[1], started_ns, time.time_ns(),
                           probe=probe)

    @oom_as_out_of_memory
    @torch.inference_mode()
    def layer_reports(self, output: BatchOutput) -> BatchOutput:
        """The traced rows' per-layer reports, logit lens decoded here: called after the answers
        went out, since decoding every block costs about one more unembedding of n_layer rows."""
        per_row, timeline = output.probe.reports(self.unembed)
        return replace(output, layers=dict(zip(output.probe.rows, per_row)), timeline=timeline, probe=None)

    def unembed(self, rows: torch.Tensor) -> torch.Tensor:
        """lm_head over (N, d_model) rows -> (N, vocab).

        On CPU, MKL computes 4..15 rows one at a time (13 rows: 40 ms; 16 rows: 16 ms for
        GPT-2 small on our 2-core machine), so such inputs are padded to 16 rows."""
        n = rows.shape[0]
        if self.device.type == "cpu" and SLOW_GEMM_ROWS[0] <= n < SLOW_GEMM_ROWS[1]:
            padded = torch.zeros(SLOW_GEMM_ROWS[1], rows.shape[1], dtype=rows.dtype, device=rows.device)
            padded[:n] = rows
            return self.model.lm_head(padded)[:n]
        return self.model.lm_head(rows)

    def left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)  # (B, T), 1 = real token
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, length - len(prompt):] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, T), 0 at first real token
        to = dict(device=self.device, non_blocking=True)
        return input_ids.to(**to), attention_mask.to(**to), position_ids.to(**to)
