"""Decode steps on a CPU, run as TorchScript traces: the same ops, called from C++.

A decode step of GPT-2 small is about 1500 small torch ops, and on a CPU calling them from
Python was a third of an int8 step (docs/benchmarks-history.md, "TorchScript"). CUDA graphs
(engine.cuda_graphs) do not exist there, but `torch.jit.trace` records the step once and
replays its ops without Python. The recorded graph gives the same numbers bit for bit.

One trace per attention span, for any number of rows: the rows' count flows through the trace
as a tensor size, so it needs no padding and no bucket per batch size (a server limited to one
sequence keeps a one-row trace) (a trace holds about
35 MB; spans are powers of two, so a server keeps a handful). The cache's tensors are inputs of
the trace, not constants in it, so a trace stays valid when the cache grows or shrinks
(engine.kv_cache); it only slices them.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from .lora import AdapterRows

# (B,) tokens, (B,) positions, span -> (B, V) logits; reads and writes the cache it was given
DecodeForward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
TOKENS, POSITIONS = 0, 1
# A step with adapter rows is traced once its signature (span, the adapters' count, rank and
# targets) came this many times, so a set of adapters seen once costs no trace; at most this many
# (each holds about what a base trace does, docs/fine-tuned.md; past them, such steps run eagerly).
ADAPTER_TRACE_AFTER, MAX_ADAPTER_TRACES = 3, 8


class _Step(nn.Module):
    """What a trace records. The model is a submodule, so its weights (packed int8 ones too)
    belong to the trace; the cache's tensors come in as arguments."""

    def __init__(self, model: nn.Module, forward: DecodeForward, span: int, cache):
        super().__init__()
        self.model, self.step, self.span, self.cache = model, forward, span, cache

    def forward(self, inputs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # The forward reads the cache's own attributes; they are these very tensors, which is
        # how the tracer records them as inputs.
        assert keys is self.cache.keys and values is self.cache.values
        return self.step(inputs[TOKENS], inputs[POSITIONS], self.span)  # (B, V)


class _AdapterStep(_Step):
    """A step with LoRA adapter rows (engine.lora): the adapters' stacks and mask come in as
    arguments too, so one trace serves every set of adapters of the same count, rank and targets."""

    def __init__(self, model: nn.Module, forward, span: int, cache, signature: tuple):
        super().__init__(model, forward, span, cache)
        self.signature = signature

    def forward(self, inputs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,  # type: ignore[override]
                *adapter_tensors: torch.Tensor) -> torch.Tensor:
        assert keys is self.cache.keys and values is self.cache.values
        rows = AdapterRows.traced(self.signature, len(self.model.blocks), adapter_tensors)
        return self.step(inputs[TOKENS], inputs[POSITIONS], self.span, rows)  # (B, V)


class TracedDecode:
    def __init__(self, forward: DecodeForward, model: nn.Module, cache):
        self.forward, self.model, self.cache = forward, model, cache
        self.traces: dict[int, torch.jit.ScriptModule] = {}  # span -> its trace
        self.adapter_traces: dict[tuple, torch.jit.ScriptModule] = {}  # (span, adapters' signature) -> its trace
        self._seen: dict[tuple, int] = {}  # adapter steps eager so far, by key (traced at ADAPTER_TRACE_AFTER)

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, span: int,
            adapters: AdapterRows | None = None) -> torch.Tensor | None:
        """(B,) tokens at (B,) positions -> (B, V) logits, attending over `span` positions. With
        adapter rows: None where the step is to run eagerly (a signature not seen often enough yet,
        or MAX_ADAPTER_TRACES traced already)."""
        inputs = torch.stack((tokens, positions))  # (2, B)
        if adapters is None:
            traced = self.traces.get(span) or self._trace(inputs, span)
            return traced(inputs, self.cache.keys, self.cache.values)
        signature, tensors = adapters.trace_inputs(len(self.model.blocks), self.model.wpe.weight.dtype)
        key = (span, signature)
        traced = self.adapter_traces.get(key)
        if traced is None:
            self._seen[key] = seen = self._seen.get(key, 0) + 1
            if seen < ADAPTER_TRACE_AFTER or len(self.adapter_traces) >= MAX_ADAPTER_TRACES:
                return None
            traced = self._trace(inputs, span, signature, tensors)
        return traced(inputs, self.cache.keys, self.cache.values, *tensors)

    def _trace(self, inputs: torch.Tensor, span: int, signature: tuple | None = None,
               tensors: Sequence[torch.Tensor] = ()) -> torch.jit.ScriptModule:
        """Record a step at this span (running it once). A trace of one row would keep sizes of 1
        as constants, so one row is traced beside a dummy second row: token 0 at position 0 of
        slot 1, which no sequence holds while one runs (a prefill rewrites it before use); with
        adapters, the dummy row takes none (a column of zeros in the mask)."""
        example, example_tensors = inputs, list(tensors)
        if inputs.shape[1] == 1 and self.cache.max_slots >= 2:
            example = torch.cat((inputs, torch.zeros_like(inputs)), dim=1)  # (2, 2)
            self.cache.reserve(2, span)
            if signature is not None and signature[3]:  # the mask (K r, N): a base row more
                example_tensors[0] = torch.cat((tensors[0], torch.zeros_like(tensors[0])), dim=1)
        step = _Step(self.model, self.forward, span, self.cache) if signature is None else \
            _AdapterStep(self.model, self.forward, span, self.cache, signature)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer notes that d_model is kept as a constant
            traced = torch.jit.trace(step, (example, self.cache.keys, self.cache.values, *example_tensors),
                                     check_trace=False, _store_inputs=False)
        # TorchScript's executor profiles a graph's first run and optimizes it during the second
        # (about 100 ms for GPT-2 small on 2 cores): both here, so that no step after the trace,
        # the first one after ready included, pays them. A step writes the same keys and values
        # at the same positions each time it runs, so running it twice more changes nothing.
        for _ in range(2):
            traced(inputs, self.cache.keys, self.cache.values, *tensors)
        if signature is None:
            self.traces[span] = traced
        else:
            self.adapter_traces[(span, signature)] = traced
        return traced
