"""Per-step traces of a generation (trace_steps): how the model chose each token.

Step i is the forward that chose token i: the prompt's (the prefill) for i = 0, then the
previous token's row alone, attending over the keys and values of every position so far (the
KV cache). The generation itself runs untouched on its fast path (continuous batching, traced
or graphed decode steps); each step is traced beside it, as a next-token forward over the same
sequence with the layer probe and attention maps (the same weights, so the same numbers), and
the decode step's view is that forward's last row: its attention over all the keys, its logit
lens, its top tokens. Nothing of this runs unless asked for: `StepTracer` exists only then.

A generation with sampling controls (penalties, logit_bias, min_tokens, structured output) sends
them with each traced forward (StepControls): the engine applies them to that forward's last row
as the generation's own step did (the same code, the token history and the grammar's state
rebuilt from the sequence), so the step shows its top tokens before and after them and how many
tokens they left possible.

    GenerationStream.put(token i) ── StepTracer.trace(i, prompt + tokens[:i]) ── Future[chunk with step]
    chunks() awaits each future in order, so steps stream as soon as each is traced.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Callable

from gpt2serve_client.generation import GenerateChunk, GenerationStep
from gpt2serve_client.types import ShapeStep, TokenLogprob

from ..introspection.walkthrough import data_step as data
from ..protocol import NextTokenOutput, NextTokenRequest, SamplingParams, StepControls, TraceContext
from ..telemetry.spans import RequestTelemetry

STEP_TOP_K = 5  # the most likely tokens shown at each step


class StepTracer:
    """The traces of one generation's steps, each a task that yields its chunk with `step` set."""

    def __init__(self, engine, trace: TraceContext, request: RequestTelemetry, token_text: Callable[[int], str],
                 params: SamplingParams, prompt_length: int, adapter: str | None = None):
        """`adapter`: the generation's LoRA adapter, which its traced steps run under too."""
        self.engine, self.trace, self.request, self.token_text = engine, trace, request, token_text
        self.adapter = adapter
        self.controls = StepControls(params, prompt_length) if params.controlled else None
        self.pending: list[asyncio.Future] = []
        self.last_ns = time.time_ns()  # the previous step's end: the prefill starts with the request

    def trace_step(self, index: int, sequence: list[int], chunk: GenerateChunk) -> asyncio.Future:
        """Trace the step that chose `chunk.token` from `sequence` (the prompt and the tokens before it)."""
        started_ns, self.last_ns = self.last_ns, time.time_ns()
        task = asyncio.ensure_future(self._traced(index, list(sequence), chunk, started_ns, self.last_ns))
        self.pending.append(task)
        return task

    async def _traced(self, index: int, sequence: list[int], chunk: GenerateChunk, started_ns: int,
                      ended_ns: int) -> GenerateChunk:
        request = NextTokenRequest([sequence], STEP_TOP_K, self.trace, controls=self.controls, adapter=self.adapter)
        [out] = await self.engine.next_token(request)
        step = build_step(index, sequence, out, chunk.token.token_id, self.token_text)
        self.request.step_span(step, started_ns, ended_ns)
        return replace(chunk, step=step)

    def cancel(self) -> None:
        for task in self.pending:
            task.cancel()


def build_step(index: int, sequence: list[int], out: NextTokenOutput, token_id: int,
               token_text: Callable[[int], str]) -> GenerationStep:
    """Step `index` from the traced forward over `sequence` (its reports carry attention maps)."""
    layers, length = out.layers or [], len(sequence)
    n_head = layers[0].attn_shape[0]
    # Each report's `attention` is its maps' last query rows (last_row_maps), [H * L]: the new row over the cache.
    attention = [weight for report in layers for weight in report.attention]  # (n_layer * H * L)
    shapes = {step.name: step.shape for step in out.walkthrough or []}
    d_model, (_, _, _, d_head) = shapes["token + position embeddings"][-1], shapes["Q per head"]
    rows = length if index == 0 else 1
    return GenerationStep(
        index=index, position=length - 1, context_tokens=length, new_row_shape=[rows, d_model],
        kv_cache_shape=[n_head, length, d_head], attention=attention,
        logit_lens=[report.logit_lens[0] for report in layers],
        top=[TokenLogprob(s.token_id, token_text(s.token_id), s.logprob) for s in out.top],
        walkthrough=step_walkthrough(shapes, length, rows),
        n_layer=len(layers), n_head=n_head, token_id=token_id, token=token_text(token_id),
        new_tokens=[token_text(t) for t in sequence[-rows:]],
        controlled_top=[TokenLogprob(s.token_id, token_text(s.token_id), s.logprob) for s in out.controlled_top or ()],
        allowed_tokens=out.allowed_tokens,
    )


def step_walkthrough(shapes: dict[str, list[int]], length: int, new: int) -> list[ShapeStep]:
    """One step's shapes for this sequence alone: `new` rows (the prompt's at the prefill, then
    one) over a cache of `length` keys and values per head. The model's widths come from the
    traced forward's `shapes`; its batch and padded length do not (the traced forward may have
    shared a batch with other requests, as the generation's own prefill may)."""
    _, n_head, _, d_head = shapes["Q per head"]
    d_model, d_mlp, vocab = shapes["heads merged"][-1], shapes["MLP hidden, GELU"][-1], shapes["logits"][-1]
    prefill = new == length
    return [
        data("input", "new token ids" if prefill else "new token id", [1, new],
             "the prompt" if prefill else "the token the previous step chose"),
        data("input", "new rows: token + position embeddings" if prefill else "new row: token + position embedding",
             [1, new, d_model], f"positions 0..{length - 1}" if prefill else f"at position {length - 1}"),
        data("block", "Q per head", [1, n_head, new, d_head], "every prompt row's query" if prefill
             else "the new row's query only"),
        data("block", "K cache per head", [1, n_head, length, d_head],
             "the prompt's keys: the cache starts with them" if prefill
             else "every position's keys so far: the cache grew by this row's"),
        data("block", "V cache per head", [1, n_head, length, d_head]),
        data("block", "attention row: softmax(QKᵀ / √d_head)", [1, n_head, new, length],
             "masked: each row sees its own and earlier positions" if prefill
             else "no mask: the cache holds only this and earlier positions"),
        data("block", "weights × V", [1, n_head, new, d_head]),
        data("block", "heads merged", [1, new, d_model]),
        data("block", "MLP hidden, GELU", [1, new, d_mlp]),
        data("block", "residual + MLP", [1, new, d_model]),
        data("output", "logits", [1, vocab], "the last row's only"),
        data("output", "chosen token", [1]),
    ]
