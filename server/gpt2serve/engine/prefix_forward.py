"""Forwards that read and fill the prefix cache (engine.prefix_cache), as KeyValueStores
(engine.gpt2): the model code does not change, only what a block attends over.

- BlockWriter, for a forward that computes every prompt whole (left-padded next-token batches):
  each layer's new keys and values of the full blocks go into their pool blocks as they are
  made, and the attention is the forward's own.
- PrefixStore, for a forward of what follows each prompt's cached blocks (right-padded): each
  layer attends over the cached blocks, gathered from the pool, then its new tokens. It fills new
  blocks the same way, and with `slots` also writes the whole prompt into the generation's KV
  cache (engine.kv_cache), which then decodes as if it had prefilled every token.

The pool's blocks are copied into each forward (a gather per layer), not read in place: torch
has no CPU attention kernel over scattered blocks, and the gather costs about as much memory
traffic as the attention's own reads of those keys (measured in bench/prefix_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..protocol import PromptScores
from .head import ScoredSpan, score_prompts
from .kv_cache import KVCache
from .prefix_cache import BLOCK, NULL_BLOCK, PrefixCache, RowPlan


@dataclass
class BlockWriter:
    """Where the new blocks' tokens sit in the forward: row (N,), column (N,) -> pool position (N,)."""

    pool: PrefixCache
    rows: torch.Tensor
    cols: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def for_rows(cls, pool: PrefixCache, plans: Sequence[RowPlan], first_cols: Sequence[int]) -> BlockWriter:
        """`first_cols[r]`: the column of row r's first new block's first token."""
        rows, cols, positions = [], [], []
        for r, (plan, first) in enumerate(zip(plans, first_cols)):
            n = len(plan.new) * BLOCK
            rows += [r] * n
            cols += range(first, first + n)
            positions += PrefixCache.positions(plan.new)
        device = pool.device
        return cls(pool, torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(cols, dtype=torch.long, device=device),
                   torch.tensor(positions, dtype=torch.long, device=device))

    @property
    def empty(self) -> bool:
        return self.positions.numel() == 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, nh, T, hs) of this forward's tokens -> their full new blocks into the pool."""
        if self.empty:
            return
        self.pool.keys[layer].index_copy_(0, self.positions, k[self.rows, :, self.cols])  # (N, nh, hs)
        self.pool.values[layer].index_copy_(0, self.positions, v[self.rows, :, self.cols])

    def write_hidden(self, hidden: torch.Tensor) -> None:
        """(B, T, C) residual stream after the last block -> the new blocks' rows of the pool."""
        if not self.empty:
            self.pool.hidden.index_copy_(0, self.positions, hidden[self.rows, self.cols])  # (N, C)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, k, v)
        return k, v


@dataclass
class PrefixBatch:
    """A right-padded forward of each prompt's uncached tokens, with what it needs around it."""

    ids: torch.Tensor  # (B, T) new tokens, right-padded
    positions: torch.Tensor  # (B, T) their positions in the prompt (padding: its last one)
    mask: torch.Tensor  # (B, 1, T, P + T) bool: cached positions, then the new tokens causally
    new_lengths: list[int]  # S_b: uncached tokens per row
    cached: list[int]  # P_b: cached tokens per row
    reads: torch.Tensor  # (B, P) pool positions of each row's cached tokens (null-block padded)


def prefix_batch(prompts: Sequence[Sequence[int]], plans: Sequence[RowPlan], pad_id: int,
                 device: torch.device) -> PrefixBatch:
    cached = [plan.cached_tokens for plan in plans]
    new = [list(p[c:]) for p, c in zip(prompts, cached)]
    lengths = [len(n) for n in new]
    B, T, P = len(prompts), max(lengths), max(cached)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    for row, tokens in enumerate(new):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    cols = torch.arange(T)  # (T,)
    lengths_t, cached_t = torch.tensor(lengths), torch.tensor(cached)  # (B,) each
    valid = cols[None, :] < lengths_t[:, None]  # (B, T)
    # A padding query stands at its row's last position: in range, and it sees real keys only.
    positions = cached_t[:, None] + torch.minimum(cols[None, :], lengths_t[:, None] - 1)  # (B, T)
    seen_cached = (torch.arange(P)[None, :] < cached_t[:, None])[:, None, :].expand(B, T, P)  # (B, T, P)
    seen_new = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]  # (B, T, T)
    mask = torch.cat([seen_cached, seen_new], dim=2)[:, None]  # (B, 1, T, P + T)
    reads = torch.full((B, P), NULL_BLOCK * BLOCK, dtype=torch.long)  # (B, P)
    for row, plan in enumerate(plans):
        reads[row, :plan.cached_tokens] = torch.tensor(PrefixCache.positions(plan.hit), dtype=torch.long)
    return PrefixBatch(ids.to(device), positions.to(device), mask.to(device), lengths, cached, reads.to(device))


class PrefixStore:
    """Attends each row over its cached tokens (gathered from the pool) and its new ones; fills
    the new full blocks (`writer`) and, with `slots`, the rows' KV-cache slots first, first+1, ..."""

    def __init__(self, pool: PrefixCache | None, batch: PrefixBatch, writer: BlockWriter | None,
                 slots: KVCache | None = None, first_slot: int = 0):
        self.pool, self.batch, self.writer = pool, batch, writer
        self.slots, self.first_slot = slots, first_slot

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nh, T, hs = k.shape  # (B, nh, T, hs): the new tokens'
        if self.writer is not None:
            self.writer.write(layer, k, v)
        P = self.batch.reads.shape[1]
        if P:
            flat = self.batch.reads.reshape(-1)  # (B * P,)
            cached_k = self.pool.keys[layer].index_select(0, flat).view(B, P, nh, hs).transpose(1, 2)  # (B, nh, P, hs)
            cached_v = self.pool.values[layer].index_select(0, flat).view(B, P, nh, hs).transpose(1, 2)
            k_all, v_all = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)  # (B, nh, P + T, hs)
        else:
            k_all, v_all = k, v
        if self.slots is not None:
            self._fill_slots(layer, k_all, v_all, P)
        return k_all, v_all

    def _fill_slots(self, layer: int, k_all: torch.Tensor, v_all: torch.Tensor, P: int) -> None:
        """Row b's prompt, cached then new, into its slot's positions 0..L_b-1."""
        keys, values = self.slots.keys[layer], self.slots.values[layer]  # (S, nh, L, hs)
        same_prefix = all(c == P for c in self.batch.cached)
        if same_prefix:  # the common case: one copy for the whole batch
            slots = slice(self.first_slot, self.first_slot + k_all.shape[0])
            keys[slots, :, :k_all.shape[2]] = k_all
            values[slots, :, :v_all.shape[2]] = v_all
            return
        for row, (c, n) in enumerate(zip(self.batch.cached, self.batch.new_lengths)):
            slot = self.first_slot + row
            keys[slot, :, :c] = k_all[row, :, :c]
            values[slot, :, :c] = v_all[row, :, :c]
            keys[slot, :, c:c + n] = k_all[row, :, P:P + n]
            values[slot, :, c:c + n] = v_all[row, :, P:P + n]

    def full_hidden(self, hidden: torch.Tensor, row: int) -> torch.Tensor:
        """Row `row`'s residual stream over its whole prompt (L, C): cached rows from the pool,
        then this forward's (B, T, C)."""
        c, n = self.batch.cached[row], self.batch.new_lengths[row]
        cached = self.pool.hidden.index_select(0, self.batch.reads[row, :c]) if c else hidden[row, :0]
        return torch.cat([cached, hidden[row, :n]])  # (L, C)

    def scores(self, hidden: torch.Tensor, prompts: Sequence[Sequence[int]], scored_rows: dict[int, int],
               head, vocab_size: int) -> dict[int, PromptScores]:
        """Every position of the scored rows' prompts (engine.head), cached ones included."""
        if not scored_rows:
            return {}
        if not any(self.batch.cached[row] for row in scored_rows):  # prompts start at column 0
            spans = [ScoredSpan(row, 0, len(prompts[row]), k) for row, k in scored_rows.items()]
            return dict(zip(scored_rows, score_prompts(hidden, self.batch.ids, spans, head, vocab_size)))
        out = {}
        for row, k in scored_rows.items():  # one at a time: each with its cached rows in front
            ids = torch.tensor(prompts[row], dtype=torch.long, device=hidden.device)[None]  # (1, L)
            full = self.full_hidden(hidden, row)[None]  # (1, L, C)
            out[row] = score_prompts(full, ids, [ScoredSpan(0, 0, len(prompts[row]), k)], head, vocab_size)[0]
        return out

    def last_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, C): each row at its last real token."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = torch.tensor(self.batch.new_lengths, device=hidden.device) - 1
        return hidden[rows, last]
