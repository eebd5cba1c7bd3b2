"""Decode steps replayed as CUDA graphs: one launch for a step of every running sequence.

A decode step is the most launch-bound forward there is (one token per row), and it runs once
per generated token, so on cuda it is captured per bucket (batch rows, attention span) like the
next-token forward (engine.cuda_graphs, whose budget and lazy capture this reuses). Rows past
the running ones are padding: they feed the pad token at position 0 of slots no sequence holds
(the cache keeps running sequences in slots 0..n-1), which a prefill overwrites before use.
Without capture (the CPU, tests) the same buffers run eagerly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .cuda_graphs import BucketedForward, _Bucket
from .padding import Buckets, batch_buckets, length_buckets

MIN_SPAN = 64
TOKENS, POSITIONS = 0, 1

# (B,) tokens, (B,) positions, span -> (B, V) logits
DecodeForward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DecodeGraphs(BucketedForward):
    def __init__(self, forward: DecodeForward, *, slots: int, n_ctx: int, device: torch.device, vocab_size: int,
                 pad_id: int, capture: bool, memory_budget_bytes: int):
        buckets = Buckets(tuple(batch_buckets(slots)), tuple(length_buckets(n_ctx, MIN_SPAN)))
        super().__init__(forward, buckets, device=device, vocab_size=vocab_size, pad_id=pad_id, capture=capture,
                         memory_budget_bytes=memory_budget_bytes)

    @torch.inference_mode()
    def run_decode(self, tokens: torch.Tensor, positions: Sequence[int]) -> torch.Tensor | None:
        """(B,) tokens on the device (the generator's last_ids) at these positions -> (B, V) logits
        for the rows' next tokens, a view of the shared output (valid until the next run); None
        when no bucket holds this step (run it eagerly). Waits for nothing: the positions go
        through a pinned buffer of their own (the last step's may still be in flight, its copy
        from its own buffer not yet done)."""
        shape = self.buckets.shape_for(len(tokens), max(positions) + 1)
        bucket = self._bucket(shape) if shape is not None else None
        if bucket is None:
            return None
        rows = len(tokens)
        staged = torch.zeros(shape[0], dtype=torch.long, pin_memory=self.device.type == "cuda")  # (B_bucket,)
        staged[:rows] = torch.tensor(positions)
        bucket.inputs[POSITIONS].copy_(staged, non_blocking=True)
        bucket.inputs[TOKENS, :rows].copy_(tokens)
        bucket.inputs[TOKENS, rows:] = self.pad_id
        self._launch(bucket)
        return self.output[:rows]

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros((2, shape[0]), dtype=torch.long, device=self.device)  # (2, B): tokens, positions

    def _step(self, bucket: _Bucket) -> None:
        inputs = bucket.inputs
        logits = self.forward(inputs[TOKENS], inputs[POSITIONS], bucket.shape[1])  # (B, V), span from the bucket
        self.output[:inputs.shape[1]].copy_(logits)
