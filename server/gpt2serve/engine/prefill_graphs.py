"""Prefills of short prompts replayed as CUDA graphs: one launch for a whole prefill step.

An eager prefill of GPT-2 small is launch-bound on a card as a next-token forward is (engine.
cuda_graphs): about 2,800 torch calls from Python for 16 prompts of 5 tokens. On an H100 the
served prefill step took 20.5 ms on average at 16 sequences (fcf3306, bench --generate at 1 to
256 streams), against 1.5 ms for a decode step of 36, and every prefill stalls every running
stream. So a prefill whose prompts need nothing from the prefix cache (no cached block to read,
no new block to keep: engine.step_forward does those) is captured per bucket (rows, columns).

Prompts are right-padded, so attention is causal and a real token never sees padding. Each row
writes its keys and values at positions 0..T-1 of its own slot (columns past its prompt write
positions past its length, which the decode mask hides and the next decode steps overwrite).
Rows past the prompts are padding: they all target one slot that is not a new one's (the first
after them, or where the cache is full the last before them) and write back what is there, so
they change nothing, whichever of them lands last (engine.kv_cache.PrefillSlots).

The (3, B, T) input buffer holds ids, positions, and in its third plane each row's slot, last
real column and whether it is real. Without capture (the CPU, tests) the same buffers run
eagerly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .cuda_graphs import BucketedForward, _Bucket
from .padding import Buckets, batch_buckets, length_buckets

MAX_LEN = 128  # longest prompt prefilled from a graph; longer ones are few and their forward is not launch-bound
MIN_LEN = 8
WARM_LEN = 8  # the column bucket captured at warm-up for every row bucket (short prompts); others lazily
IDS, POSITIONS, ROWS = 0, 1, 2
SLOT, LAST, REAL = 0, 1, 2  # columns of the ROWS plane

# (B, T) ids, (B, T) positions, (B,) slots, (B,) last columns, (B,) bool real rows (else padding)
#   -> (B, V) logits after each row's last token
PrefillForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PrefillGraphs(BucketedForward):
    def __init__(self, forward: PrefillForward, *, slots: int, n_ctx: int, device: torch.device, vocab_size: int,
                 pad_id: int, capture: bool, memory_budget_bytes: int):
        self.slots = slots
        buckets = Buckets(tuple(batch_buckets(slots)), tuple(length_buckets(min(n_ctx, MAX_LEN), MIN_LEN)))
        super().__init__(forward, buckets, device=device, vocab_size=vocab_size, pad_id=pad_id, capture=capture,
                         memory_budget_bytes=memory_budget_bytes)

    def warm_up(self, shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """Capture every row bucket at WARM_LEN columns (the default), largest first."""
        super().warm_up(shapes if shapes is not None else [(b, WARM_LEN) for b in self.buckets.batch])

    def shape_for(self, prompts: Sequence[Sequence[int]]) -> tuple[int, int] | None:
        """The bucket these prompts would run at; None: prefill them eagerly (too long)."""
        return self.buckets.shape_for(len(prompts), max(len(p) for p in prompts))

    def padding_slot(self, first_slot: int, count: int) -> int:
        """The one slot every padding row of a prefill into slots first_slot .. first_slot +
        count - 1 targets: not a new one's, the first after them or, where the cache is full, the
        last before them (a full cache with padding rows has running sequences before the new)."""
        return first_slot + count if first_slot + count < self.slots else first_slot - 1

    @torch.inference_mode()
    def run_prefill(self, prompts: Sequence[Sequence[int]], first_slot: int,
                    shape: tuple[int, int]) -> torch.Tensor | None:
        """Each prompt's keys and values into slots first_slot, first_slot + 1, ... (all within
        the slots) and (P, V) logits of the token after each one, a view of the shared output
        (valid until the next run), at bucket `shape` (shape_for); None over the graphs' memory
        budget."""
        bucket = self._bucket(shape)
        if bucket is None:
            return None
        B, T = shape
        # A buffer of its own, pinned on cuda (an asynchronous copy), as every launch stages its inputs.
        staged = torch.empty((3, B, T), dtype=torch.long, pin_memory=self.device.type == "cuda")
        staged[IDS].fill_(self.pad_id)
        staged[POSITIONS] = torch.arange(T)  # padding columns and rows too: in range, never read
        staged[ROWS].zero_()
        P = len(prompts)
        staged[ROWS, :P, SLOT] = torch.arange(first_slot, first_slot + P)
        staged[ROWS, :P, REAL] = 1
        staged[ROWS, P:, SLOT] = self.padding_slot(first_slot, P)
        for row, prompt in enumerate(prompts):
            staged[IDS, row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            staged[ROWS, row, LAST] = len(prompt) - 1
        bucket.inputs.copy_(staged, non_blocking=True)
        self._launch(bucket)
        return self.output[:len(prompts)]

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        inputs = torch.zeros((3, *shape), dtype=torch.long, device=self.device)  # (3, B, T)
        inputs[POSITIONS] = torch.arange(shape[1], device=self.device)
        inputs[ROWS, :, SLOT] = torch.arange(shape[0], device=self.device)  # distinct slots for the capture's runs
        inputs[ROWS, :, REAL] = 1
        return inputs

    def _step(self, bucket: _Bucket) -> None:
        inputs = bucket.inputs
        rows = inputs[ROWS]  # (B, T): slot, last column and real in the first three columns
        logits = self.forward(inputs[IDS], inputs[POSITIONS], rows[:, SLOT], rows[:, LAST],
                              rows[:, REAL].bool())  # (B, V)
        self.output[:inputs.shape[1]].copy_(logits)
