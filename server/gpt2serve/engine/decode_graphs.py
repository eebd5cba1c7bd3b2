"""Decode steps replayed as CUDA graphs: one launch for a step of every running sequence.

A decode step is the most launch-bound forward there is (one token per row), and it runs once
per generated token, so on cuda it is captured per bucket (batch rows, attention span) like the
next-token forward (engine.cuda_graphs, whose budget and lazy capture this reuses). Rows past
the running ones are padding: they feed the pad token at position 0 of slots no sequence holds
(the cache keeps running sequences in slots 0..n-1), which a prefill overwrites before use.

On a CPU there are no CUDA graphs, but the same problem in another form: a decode step of GPT-2
small is about 1500 small torch ops, and Python's share of calling them was 5-10 ms of a 20 ms
int8 step (2-core AVX2 machine). So there each bucket is traced once with TorchScript
(`torch.jit.trace`) and the trace runs the same ops from C++. The cache's tensors are inputs
of the trace, not constants in it, so a trace stays valid when the cache grows or shrinks
(engine.kv_cache); it only slices them. With `trace` off (tests) the buffers run eagerly.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from .cuda_graphs import BucketedForward, _Bucket
from .padding import Buckets, batch_buckets, length_buckets

MIN_SPAN = 64
TOKENS, POSITIONS = 0, 1

# (B,) tokens, (B,) positions, span -> (B, V) logits
DecodeForward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class _TracedStep(nn.Module):
    """What a CPU trace records. The model is a submodule, so its weights (packed int8 ones too)
    belong to the trace; the cache's tensors come in as arguments."""

    def __init__(self, model: nn.Module, forward: DecodeForward, span: int, cache):
        super().__init__()
        self.model, self.step, self.span, self.cache = model, forward, span, cache

    def forward(self, inputs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        assert keys is self.cache.keys and values is self.cache.values  # traced as inputs, by identity
        return self.step(inputs[TOKENS], inputs[POSITIONS], self.span)  # (B, V)


class DecodeGraphs(BucketedForward):
    def __init__(self, forward: DecodeForward, *, slots: int, n_ctx: int, device: torch.device, vocab_size: int,
                 pad_id: int, capture: bool, memory_budget_bytes: int, trace: tuple[nn.Module, object] | None = None):
        """`trace`: (model, cache) to trace each bucket with on a CPU (see above); None: eager."""
        buckets = Buckets(tuple(batch_buckets(slots)), tuple(length_buckets(n_ctx, MIN_SPAN)))
        super().__init__(forward, buckets, device=device, vocab_size=vocab_size, pad_id=pad_id, capture=capture,
                         memory_budget_bytes=memory_budget_bytes)
        self.trace = trace
        self.traces: dict[tuple[int, int], torch.jit.ScriptModule] = {}

    def shape_for(self, rows: int, length: int) -> tuple[int, int] | None:
        """The bucket (rows, span) a step of `rows` sequences, the longest `length` positions
        with its new token, runs at; None: no bucket holds it."""
        return self.buckets.shape_for(rows, length)

    @torch.inference_mode()
    def run_decode(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor | None:
        """(B, V) logits for the rows' next tokens, a view of the shared output (valid until the
        next run); None when no bucket holds this step (run it eagerly)."""
        shape = self.buckets.shape_for(len(tokens), max(positions) + 1)
        bucket = self._bucket(shape) if shape is not None else None
        if bucket is None:
            return None
        rows = len(tokens)
        staged = self.staging[:2 * shape[0]].view(2, shape[0])
        staged.zero_()
        staged[TOKENS, :] = self.pad_id
        staged[TOKENS, :rows] = torch.tensor(tokens)
        staged[POSITIONS, :rows] = torch.tensor(positions)
        bucket.inputs.copy_(staged, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        elif self.trace is not None:
            model, cache = self.trace
            traced = self.traces.get(shape) or self._trace(bucket, model, cache)
            return traced(bucket.inputs, cache.keys, cache.values)[:rows]
        else:
            self._step(bucket)
        return self.output[:rows]

    def _trace(self, bucket: _Bucket, model: nn.Module, cache) -> torch.jit.ScriptModule:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on Python values it keeps as constants
            traced = torch.jit.trace(_TracedStep(model, self.forward, bucket.shape[1], cache),
                                     (bucket.inputs, cache.keys, cache.values), check_trace=False)
        self.traces[bucket.shape] = traced
        return traced

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros((2, shape[0]), dtype=torch.long, device=self.device)  # (2, B): tokens, positions

    def _step(self, bucket: _Bucket) -> None:
        inputs = bucket.inputs
        logits = self.forward(inputs[TOKENS], inputs[POSITIONS], bucket.shape[1])  # (B, V), span from the bucket
        self.output[:inputs.shape[1]].copy_(logits)
