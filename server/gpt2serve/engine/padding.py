"""Left padding with tensor ops, right padding for traced batches, and the shape buckets CUDA graphs are captured for.

A batch becomes one (3, B, T) int64 tensor, [token ids, position ids, real-token mask], so it
reaches the device in one copy. Every prompt's last token sits in column T-1; positions count
from 0 at its first real token. Rows past the prompts (bucket padding) are all padding.
The work is a handful of tensor ops whatever the batch size. The per-row Python loop this
replaced made host work grow with the batch (issue 11, H100: 27 ms a forward at 1024 rows
against 8 ms for the bare model).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

IDS, POSITIONS, VALID = range(3)

# On a CPU a batch runs in forwards of at most this many computed (padded) tokens: past it, a
# forward's activations leave the cache, and one big forward was slower than its parts
# (docs/benchmarks.md, "Next-token batches in parts on a CPU"). The schedulers cannot cap it:
# they see whole prompts, not what the prefix cache spares of them.
CPU_FORWARD_TOKENS = 512


def forward_parts(new_lengths: Sequence[int], budget: int | None) -> list[tuple[int, int]]:
    """Rows [a, b) of a batch per forward, in order: each part's rows x its longest new part
    within `budget` (None: one part), a row alone whatever its length."""
    parts, start, longest = [], 0, 0
    for row, n in enumerate(new_lengths):
        if budget is not None and row > start and (row - start + 1) * max(longest, n) > budget:
            parts.append((start, row))
            start, longest = row, 0
        longest = max(longest, n)
    return parts + [(start, len(new_lengths))] if new_lengths else []


def right_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Prompts as (R, T) ids, each from column 0, padded to the longest at the end."""
    T = max(map(len, prompts))
    return torch.tensor([[*p, *[pad_id] * (T - len(p))] for p in prompts], dtype=torch.long).to(device)


def left_pad_into(out: torch.Tensor, prompts: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Fill `out` (3, B, T), a CPU tensor, with the left-padded batch; B >= len(prompts), T >= the
    longest. In numpy, on `out`'s memory: torch's per-op cost made the same steps 3x slower at the
    batch sizes next-token calls run (113 against 32 µs for 64 five-token prompts)."""
    P = len(prompts)
    lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=P)  # (P,)
    flat = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(lengths.sum()))  # (N,)
    T = out.shape[2]
    batch = out.numpy()  # (3, B, T), the same memory
    batch[IDS].fill(pad_id)
    batch[POSITIONS:].fill(0)
    if P and (lengths == lengths[0]).all():  # prompts of one length (a bench's, or a client's batch): plain slices
        n = int(lengths[0])
        batch[IDS, :P, T - n:] = flat.reshape(P, n)
        batch[POSITIONS, :P, T - n:] = np.arange(n)
        batch[VALID, :P, T - n:] = 1
        return out
    rows = np.repeat(np.arange(P), lengths)  # (N,) each token's prompt
    starts = np.cumsum(lengths) - lengths  # (P,) each prompt's offset in `flat`
    offsets = np.arange(flat.size) - starts[rows]  # (N,) position within its prompt
    cols = (T - lengths)[rows] + offsets  # (N,) its column once left-padded
    batch[IDS, rows, cols] = flat
    batch[POSITIONS, rows, cols] = offsets
    batch[VALID, rows, cols] = 1
    return out


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, batch: int = 0, length: int = 0) -> torch.Tensor:
    """A new (3, B, T) batch on the CPU; B and T default to the prompts' own."""
    shape = (3, max(batch, len(prompts)), max(length, max(len(p) for p in prompts)))
    return left_pad_into(torch.empty(shape, dtype=torch.long), prompts, pad_id)


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of half a power of two (12, 16, 24, 32, 48, ...), so at most a third
    of a bucket's rows are padding; up to max_batch_size (always a bucket)."""
    sizes, size = [1, 2, 4, 8], 8
    while size < max_batch_size:
        sizes += [size * 3 // 2, size * 2]
        size *= 2
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def length_buckets(n_ctx: int, smallest: int = 8) -> list[int]:
    """Powers of two from `smallest`, and n_ctx itself."""
    sizes, size = [], smallest
    while size < n_ctx:
        sizes.append(size)
        size *= 2
    return sizes + [n_ctx]


@dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def for_model(cls, max_batch_size: int, n_ctx: int) -> Buckets:
        return cls(tuple(batch_buckets(max_batch_size)), tuple(length_buckets(n_ctx)))

    def shape_for(self, batch: int, length: int) -> tuple[int, int] | None:
        """The smallest bucket that holds a (batch, length) input, or None past the largest."""
        b = bisect.bisect_left(self.batch, batch)
        t = bisect.bisect_left(self.length, length)
        if b == len(self.batch) or t == len(self.length):
            return None
        return self.batch[b], self.length[t]
