"""Forwards that read and fill the prefix cache (engine.prefix_cache), as KeyValueStores
(engine.gpt2): the model code does not change, only what a block attends over.

- BlockWriter, for a forward that computes every prompt whole (left-padded next-token batches):
  each layer's new keys and values of the full blocks go into their pool blocks as they are
  made, and the attention is the forward's own.
- PrefixStore, for a forward of what follows each prompt's cached blocks: each layer attends over
  the cached blocks, gathered from the pool, then the new tokens. It fills new blocks the same
  way, and with `slots` also writes the whole prompt into the generation's KV cache
  (engine.kv_cache), which then decodes as if it had prefilled every token.

Two layouts for the second (PrefixBatch):
- packed: every prompt's new tokens side by side in one row, after the distinct cached blocks of
  the whole batch, gathered once; the mask gives each token its own prompt's blocks and its own
  earlier tokens. Sixteen prompts behind one 800-token prefix gather it once, not sixteen times,
  and nothing is padded. Used while its attention (all new tokens x all keys) costs at most
  PACK_FACTOR times the rows layout's.
- rows: a row per prompt, right-padded, each gathering its own cached blocks (prompts with
  different long prefixes, or long new parts).
A packed row does not keep a numerical fault to its prompt: a NaN key or value of one prompt
reaches every query of the row through attention, as weight 0 x NaN. So a packed forward in which
more than one prompt came out non-finite is run again as rows (`needs_rows_again`), and each
prompt fails or is answered on its own numbers.
The pool is gathered, not read in place: torch has no CPU attention kernel over scattered
blocks. bench/engine/prefix_cache.py measures the layouts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from ..protocol import PromptScores
from .head import ScoredSpan, score_prompts
from .kv_cache import KVCache
from .prefix_cache import BLOCK, NULL_BLOCK, PrefixCache, RowPlan

log = logging.getLogger(__name__)

PACK_FACTOR = 2.0  # packed attention may compute this many times the rows layout's query-key pairs


@dataclass
class BlockWriter:
    """Where the new blocks' tokens sit in the forward: row (N,), column (N,) -> pool position (N,)."""

    pool: PrefixCache
    rows: torch.Tensor
    cols: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def for_rows(cls, pool: PrefixCache, plans: Sequence[RowPlan], first_cols: Sequence[int],
                 rows_of: Sequence[int] | None = None) -> BlockWriter:
        """`first_cols[i]`: the column of prompt i's first new block's first token, in row
        `rows_of[i]` of the forward (default: row i)."""
        rows, cols, positions = [], [], []
        for i, (plan, first) in enumerate(zip(plans, first_cols)):
            n = len(plan.new) * BLOCK
            rows += [i if rows_of is None else rows_of[i]] * n
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
        """k, v (B, nh, T, hs) of this forward's tokens -> their full new blocks into the pool,
        gathered a token's (nh, hs) at a time. This copy is about 3% of a 16 x 64-token forward
        on a 2-core CPU (bench/engine/prefix_cache.py), which is why the doorkeeper keeps blocks only
        of prefixes seen before (engine.prefix_cache)."""
        if self.empty:
            return
        B, nh, T, hs = k.shape
        flat = self.rows * T + self.cols  # (N,) token index in (B * T)
        for pool, x in ((self.pool.keys[layer], k), (self.pool.values[layer], v)):
            pool.index_copy_(0, self.positions, x.transpose(1, 2).reshape(B * T, nh, hs).index_select(0, flat))

    def write_hidden(self, hidden: torch.Tensor) -> None:
        """(B, T, C) residual stream after the last block -> the new blocks' rows of the pool."""
        if not self.empty:
            self.pool.hidden.index_copy_(0, self.positions, hidden[self.rows, self.cols])  # (N, C)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, k, v)
        return k, v

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        return None  # a prompt's queries attend through `attend`


@dataclass
class PrefixBatch:
    """A forward of each prompt's uncached tokens (prompt i: `new_lengths[i]` tokens from column
    `starts[i]` of row `rows[i]`), with the keys and mask around them."""

    ids: torch.Tensor  # (R, T) new tokens
    positions: torch.Tensor  # (R, T) their positions in their prompts (padding: its prompt's last)
    # (R, 1, T, P + T) bool: which cached keys, then which new ones, each query sees; None when
    # nothing is cached and the rows are right-padded: then it is causal (gpt2.hidden_states)
    mask: torch.Tensor | None
    reads: torch.Tensor  # (R, P) pool positions of the cached keys in front of row r (null-block padded)
    cached: list[int]  # per prompt: tokens read from the cache
    new_lengths: list[int]  # per prompt: tokens computed
    rows: list[int]
    starts: list[int]
    hit_positions: list[torch.Tensor]  # per prompt: pool positions of its cached tokens, in order
    packed: bool


def prefix_batch(prompts: Sequence[Sequence[int]], plans: Sequence[RowPlan], pad_id: int,
                 device: torch.device, pack: bool = True) -> PrefixBatch:
    """The layout for these prompts (packed only where `pack` and it is cheaper, see above)."""
    cached = [plan.cached_tokens for plan in plans]
    new = [list(p[c:]) for p, c in zip(prompts, cached)]
    lengths = [len(n) for n in new]
    distinct = list(dict.fromkeys(block for plan in plans for block in plan.hit))  # the batch's cached blocks
    tokens, shared = sum(lengths), len(distinct) * BLOCK
    rows_pairs = sum(n * (c + n) for n, c in zip(lengths, cached))
    hits = [torch.tensor(PrefixCache.positions(plan.hit), dtype=torch.long) for plan in plans]
    if pack and len(prompts) > 1 and tokens * (shared + tokens) <= PACK_FACTOR * rows_pairs:
        batch = _packed(new, cached, plans, distinct, hits)
    else:
        batch = _rows(new, cached, hits, pad_id)
    for name in ("ids", "positions", "mask", "reads"):
        if getattr(batch, name) is not None:
            setattr(batch, name, getattr(batch, name).to(device))
    batch.hit_positions = [h.to(device) for h in batch.hit_positions]
    return batch


def needs_rows_again(batch: PrefixBatch, failed: Collection[int]) -> bool:
    """Packed, and more than one prompt not finite: one of them may have poisoned the others."""
    if not (batch.packed and len(failed) > 1):
        return False
    log.warning("%d of %d packed prompts came out non-finite; running them again in rows", len(failed),
                len(batch.new_lengths))
    return True


def _rows(new: list[list[int]], cached: list[int], hits: list[torch.Tensor], pad_id: int) -> PrefixBatch:
    """A row per prompt, right-padded; each row's cached keys first, left-aligned."""
    lengths = [len(n) for n in new]
    B, T, P = len(new), max(lengths), max(cached)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    for row, tokens in enumerate(new):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    cols = torch.arange(T)  # (T,)
    lengths_t, cached_t = torch.tensor(lengths), torch.tensor(cached)  # (B,) each
    # A padding query stands at its row's last position, in range; its output is never read.
    positions = cached_t[:, None] + torch.minimum(cols[None, :], lengths_t[:, None] - 1)  # (B, T)
    mask = None  # nothing cached: causal, and a real query's keys are all real (padding is after)
    if P:  # with cached keys in front, a mask; there a padding query sees real keys only
        valid = cols[None, :] < lengths_t[:, None]  # (B, T)
        seen_cached = (torch.arange(P)[None, :] < cached_t[:, None])[:, None, :].expand(B, T, P)  # (B, T, P)
        seen_new = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]  # (B, T, T)
        mask = torch.cat([seen_cached, seen_new], dim=2)[:, None]  # (B, 1, T, P + T)
    reads = torch.full((B, P), NULL_BLOCK * BLOCK, dtype=torch.long)  # (B, P)
    for row, positions_of_row in enumerate(hits):
        reads[row, :len(positions_of_row)] = positions_of_row
    return PrefixBatch(ids, positions, mask, reads, cached, lengths, list(range(B)), [0] * B, hits, packed=False)


def _packed(new: list[list[int]], cached: list[int], plans: Sequence[RowPlan], distinct: list[int],
            hits: list[torch.Tensor]) -> PrefixBatch:
    """One row: the batch's distinct cached blocks, then every prompt's new tokens back to back."""
    lengths = [len(n) for n in new]
    N, U = sum(lengths), len(distinct)
    owner = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(lengths))  # (N,) each token's prompt
    starts = [sum(lengths[:i]) for i in range(len(new))]
    within = torch.arange(N) - torch.tensor(starts)[owner]  # (N,) index within its prompt's new tokens
    ids = torch.tensor([t for tokens in new for t in tokens], dtype=torch.long)[None]  # (1, N)
    positions = (torch.tensor(cached)[owner] + within)[None]  # (1, N)
    column = {block: i for i, block in enumerate(distinct)}
    holds = torch.zeros(len(new), U, dtype=torch.bool)  # (B, U): prompt b's cached blocks among the distinct
    for b, plan in enumerate(plans):
        holds[b, [column[block] for block in plan.hit]] = True
    seen_cached = holds.repeat_interleave(BLOCK, dim=1)[owner]  # (N, U * BLOCK)
    seen_new = (owner[None, :] == owner[:, None]) & (within[None, :] <= within[:, None])  # (N, N): own, causal
    mask = torch.cat([seen_cached, seen_new], dim=1)[None, None]  # (1, 1, N, U * BLOCK + N)
    reads = torch.tensor(PrefixCache.positions(distinct), dtype=torch.long)[None]  # (1, U * BLOCK)
    return PrefixBatch(ids, positions, mask, reads, cached, lengths, [0] * len(new), starts, hits, packed=True)


class PrefixStore:
    """Attends over the cached keys (gathered from the pool) and the new ones; fills the new full
    blocks (`writer`) and, with `slots`, prompt i's KV-cache slot first + i."""

    def __init__(self, pool: PrefixCache | None, batch: PrefixBatch, writer: BlockWriter | None,
                 slots: KVCache | None = None, first_slot: int = 0):
        self.pool, self.batch, self.writer = pool, batch, writer
        self.slots, self.first_slot = slots, first_slot
        if slots is not None:
            self._fill_cached_slots()

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        return None  # prompts attend through `attend`

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, nh, T, hs = k.shape  # (R, nh, T, hs): the new tokens'
        if self.writer is not None:
            self.writer.write(layer, k, v)
        if self.slots is not None:
            self._fill_new_slots(layer, k, v)
        P = self.batch.reads.shape[1]
        if not P:
            return k, v
        flat = self.batch.reads.reshape(-1)  # (R * P,)
        cached_k = self.pool.keys[layer].index_select(0, flat).view(R, P, nh, hs).transpose(1, 2)  # (R, nh, P, hs)
        cached_v = self.pool.values[layer].index_select(0, flat).view(R, P, nh, hs).transpose(1, 2)
        return torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)  # (R, nh, P + T, hs)

    def _fill_cached_slots(self) -> None:
        """Each prompt's cached positions into its slot, every layer at once, before the forward."""
        for i, positions in enumerate(self.batch.hit_positions):
            if len(positions):  # (the prefix cache may be off)
                self.slots.copy_in(self.first_slot + i, self.pool.keys, self.pool.values, positions)

    def _fill_new_slots(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Each prompt's new keys and values into its slot, after its cached ones."""
        keys, values, batch = self.slots.keys[layer], self.slots.values[layer], self.batch  # (S, nh, L, hs)
        if not batch.packed and len(set(batch.cached)) == 1:  # one copy for the whole batch
            c, slots = batch.cached[0], slice(self.first_slot, self.first_slot + k.shape[0])
            keys[slots, :, c:c + k.shape[2]] = k
            values[slots, :, c:c + v.shape[2]] = v
            return
        for i, (c, n, row, start) in enumerate(zip(batch.cached, batch.new_lengths, batch.rows, batch.starts)):
            keys[self.first_slot + i, :, c:c + n] = k[row, :, start:start + n]
            values[self.first_slot + i, :, c:c + n] = v[row, :, start:start + n]

    def full_hidden(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Prompt i's residual stream over its whole prompt (L, C): cached positions from the
        pool, then this forward's (R, T, C)."""
        b = self.batch
        row, start, n = b.rows[i], b.starts[i], b.new_lengths[i]
        cached = self.pool.hidden.index_select(0, b.hit_positions[i]) if b.cached[i] else hidden[row, :0]
        return torch.cat([cached, hidden[row, start:start + n]])  # (L, C)

    def scores(self, hidden: torch.Tensor, prompts: Sequence[Sequence[int]], scored_rows: dict[int, int],
               head, vocab_size: int) -> dict[int, PromptScores]:
        """Every position of the scored prompts (engine.head), cached ones included."""
        if not scored_rows:
            return {}
        if not self.batch.packed and not any(self.batch.cached[i] for i in scored_rows):  # each from column 0
            spans = [ScoredSpan(i, 0, len(prompts[i]), k) for i, k in scored_rows.items()]
            return dict(zip(scored_rows, score_prompts(hidden, self.batch.ids, spans, head, vocab_size)))
        out = {}
        for i, k in scored_rows.items():  # one at a time: each with its cached positions in front
            ids = torch.tensor(prompts[i], dtype=torch.long, device=hidden.device)[None]  # (1, L)
            full = self.full_hidden(hidden, i)[None]  # (1, L, C)
            out[i] = score_prompts(full, ids, [ScoredSpan(0, 0, len(prompts[i]), k)], head, vocab_size)[0]
        return out

    def last_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, T, C) -> (B, C): each prompt at its last token."""
        b, device = self.batch, hidden.device
        rows = torch.tensor(b.rows, device=device)
        last = torch.tensor([s + n - 1 for s, n in zip(b.starts, b.new_lengths)], device=device)
        return hidden[rows, last]
