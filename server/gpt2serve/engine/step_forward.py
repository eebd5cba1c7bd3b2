"""One forward for every row of a step (vLLM's mixed batches): D decode tokens, then prompt rows,
laid end to end as one row of N tokens. A prompt row is a next-token prompt (riding a decode step,
a "rider", or in a batch of its own), a new generation's prompt read into its cache slot (a
"joining" one), or a long prompt's next chunk (engine.chunked_prefill).

Every matrix of the model (QKV, projections, MLP, head) reads its weights once for all of them,
which on a CPU, where a small step costs a pass over the weights, is most of the step; only
attention goes its own way per kind (`StepStore`):
- decode tokens attend over their slots, as a decode step does (kv_cache.SlotStore: the
  compiled CPU kernel, or SDPA over the span);
- a prompt row computes positions [start, end) of its prompt and attends over what is known
  before `start`, then over its own tokens causally. What is known comes from the prefix cache
  (its hit blocks, gathered from the pool) or, for a chunked prompt, from its staging
  (engine.chunked_prefill), where its own keys and values go too.
Prompt rows take no KV-cache slot unless they join; their new full blocks go into the prefix
cache (`BlockWriter`).

A traced batch (introspection's taps read each prompt as a row of a batch) runs instead as its
prompts from position 0, right-padded into one (R, T) forward (`padded_forward`), through the
same store.

Two layouts of the prompt rows' attention (`StepLayout`):
- rows: right-padded (R, nh, T, hs) with a mask, each row gathering what it knows. A real query
  never sees padding, and a row's numbers (a NaN included) never reach another row;
- shared (only where asked, `pack`): the prompt tokens as they lie, one row, after the distinct
  cached blocks of all of them, gathered once; the mask gives each token its own prompt's blocks
  and its own earlier tokens. Sixteen prompts behind one 800-token prefix gather it once, not
  sixteen times, and nothing is padded. Chosen while its attention (all tokens x all keys) costs
  at most PACK_FACTOR times the rows layout's. A NaN key of one prompt reaches every query of
  the row (weight 0 x NaN), so a shared forward in which more than one prompt came out
  non-finite is run again in rows (`StepLayout.needs_rows_again`).
The pool is gathered, not read in place: torch has no CPU attention kernel over scattered
blocks. bench/engine/prefix_cache.py measures the layouts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Collection, Sequence

import torch
import torch.nn.functional as F

from ..protocol import PromptScores
from .head import ScoredSpan, score_prompts
from .kv_cache import KVCache, SlotStore
from .lora import AdapterRows, LoraAdapter
from .prefix_cache import BLOCK, PrefixCache, RowPlan

log = logging.getLogger(__name__)

PACK_FACTOR = 2.0  # the shared layout may compute this many times the rows layout's query-key pairs


@dataclass(frozen=True)
class PromptRow:
    """Positions [start, end) of `prompt`, computed this step. The keys before `start` are read:
    from the prefix cache at pool positions `reads` (its hit), or from `staging` (a chunked
    prompt, engine.chunked_prefill: object with `staging(layer, like)`), which takes this row's
    keys and values too. A row with a `slot` writes them into that KV-cache slot as well (a
    generation's prompt, whose hit the caller copied there)."""

    prompt: Sequence[int]
    start: int = 0
    end: int | None = None  # None: the prompt's end
    reads: Sequence[int] = ()
    staging: object = None
    slot: int | None = None  # a new sequence's KV-cache slot: its keys and values go there too
    adapter: LoraAdapter | None = None  # engine.lora; None: the base

    @classmethod
    def planned(cls, plan: RowPlan, slot: int | None = None, adapter: LoraAdapter | None = None) -> PromptRow:
        """A prompt from the first position after its prefix-cache hit (`plan`), reading the hit."""
        return cls(plan.tokens, plan.cached_tokens, reads=PrefixCache.positions(plan.hit), slot=slot, adapter=adapter)

    @property
    def stop(self) -> int:
        return len(self.prompt) if self.end is None else self.end

    @property
    def tokens(self) -> Sequence[int]:
        return self.prompt[self.start:self.stop]


@dataclass(frozen=True)
class StepLayout:
    """Where each prompt row's tokens sit in the packed row, and how they attend."""

    decode_rows: int  # D: the decode tokens come first
    rows: Sequence[PromptRow]
    firsts: list[int]  # packed index of each row's first token
    last: torch.Tensor  # (R,): packed index of each row's last token
    # rows layout: (R, 1, T, K + T) known keys, then own, None when nothing is known (causal);
    # shared layout: (1, 1, P, U + P) the distinct known positions, then every prompt token
    mask: torch.Tensor | None
    # rows: (R * T,) packed index of each padded (row, column), and (P,) index into the (R * T)
    # padded tokens of each packed one; None where every row is T long (the packed tokens are the padded)
    gather: torch.Tensor | None = None
    real: torch.Tensor | None = None
    shared: torch.Tensor | None = None  # shared: (U,) pool positions of the distinct known blocks

    @classmethod
    def of(cls, decode_rows: int, rows: Sequence[PromptRow], device: torch.device, pack: bool = False) -> StepLayout:
        """The rows layout, or with `pack` the shared one where it is cheaper (see above)."""
        lengths = [len(r.tokens) for r in rows]
        firsts = list(accumulate(lengths[:-1], initial=decode_rows)) if rows else []
        last = torch.tensor([f + n - 1 for f, n in zip(firsts, lengths)], dtype=torch.long, device=device)
        if pack and len(rows) > 1 and all(r.staging is None for r in rows):
            distinct = list(dict.fromkeys(p for r in rows for p in r.reads))  # pool positions, whole blocks
            tokens, pairs = sum(lengths), sum(n * (r.start + n) for r, n in zip(rows, lengths))
            if tokens * (len(distinct) + tokens) <= PACK_FACTOR * pairs:
                return cls(decode_rows, rows, firsts, last, _shared_mask(rows, lengths, distinct).to(device),
                           shared=torch.tensor(distinct, dtype=torch.long, device=device))
        T, K = max(lengths, default=1), max((r.start for r in rows), default=0)
        mask = None
        if K:
            known = torch.tensor([r.start for r in rows])[:, None] > torch.arange(K)[None, :]  # (R, K)
            own = torch.tensor(lengths)[:, None] > torch.arange(T)[None, :]  # (R, T): real keys
            causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T); a padding query sees real keys
            mask = torch.cat([known[:, None, :].expand(-1, T, -1), causal[None] & own[:, None, :]], dim=2)[:, None]
            mask = mask.to(device)
        if all(n == T for n in lengths):
            return cls(decode_rows, rows, firsts, last, mask)
        gather, real = [], []
        for r, (first, length) in enumerate(zip(firsts, lengths)):
            gather += [first + min(t, length - 1) for t in range(T)]  # padding -> its row's last token
            real += [r * T + t for t in range(length)]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(decode_rows, rows, firsts, last, mask, as_tensor(gather), as_tensor(real))

    @property
    def padded(self) -> tuple[int, int]:
        return len(self.rows), max(len(r.tokens) for r in self.rows)

    @property
    def width(self) -> int:
        """Tokens a row of attention holds: the longest row's (rows layout), or all of them (shared)."""
        return self.padded[1] if self.shared is None else sum(len(r.tokens) for r in self.rows)

    @property
    def known(self) -> int:
        """Rows layout: K, the most positions any row reads before its own."""
        return self.mask.shape[-1] - self.padded[1] if self.mask is not None else 0

    def own(self, i: int) -> slice:
        """Row i's tokens in the packed row."""
        return slice(self.firsts[i], self.firsts[i] + len(self.rows[i].tokens))

    def needs_rows_again(self, failed: Collection) -> bool:
        """Shared, and more than one prompt not finite: one of them may have poisoned the others."""
        if self.shared is None or len(failed) <= 1:
            return False
        log.warning("%d of %d packed prompts came out non-finite; running them again in rows", len(failed),
                    len(self.rows))
        return True


def _shared_mask(rows: Sequence[PromptRow], lengths: list[int], distinct: list[int]) -> torch.Tensor:
    """(1, 1, P, U + P): each prompt token sees its own prompt's known positions among the
    distinct ones, then its own prompt's tokens up to itself."""
    column = {position: i for i, position in enumerate(distinct)}
    holds = torch.zeros(len(rows), len(distinct), dtype=torch.bool)  # (R, U)
    for i, row in enumerate(rows):
        holds[i, [column[p] for p in row.reads]] = True
    owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))  # (P,) each token's row
    within = torch.cat([torch.arange(n) for n in lengths])  # (P,) index within its row
    own = (owner[None, :] == owner[:, None]) & (within[None, :] <= within[:, None])  # (P, P): own, causal
    return torch.cat([holds[owner], own], dim=1)[None, None]  # (1, 1, P, U + P)


@dataclass
class BlockWriter:
    """Where the new blocks' tokens sit in the forward: row (N,), column (N,) -> pool position (N,).
    What `StepStore` writes them with."""

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
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=pool.device)  # noqa: E731
        return cls(pool, as_tensor(rows), as_tensor(cols), as_tensor(positions))

    @property
    def empty(self) -> bool:
        return self.positions.numel() == 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, nh, T, hs) of this forward's tokens -> their full new blocks into the pool,
        gathered a token's (nh, hs) at a time. The copy costs a few percent of a forward
        (bench/engine/prefix_cache.py), which is why the doorkeeper keeps blocks only of prefixes
        seen before (engine.prefix_cache)."""
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


class StepStore:
    """The KeyValueStore (engine.gpt2) of a packed step, or of a traced batch's right-padded
    forward (padded_forward): it attends by itself."""

    def __init__(self, decode: SlotStore | None, layout: StepLayout, pool: PrefixCache | None = None,
                 writer: BlockWriter | None = None, cache: KVCache | None = None, right_padded: bool = False):
        """`writer`: over the forward's tokens, for the rows' new blocks; `cache`: where rows with
        a slot write; `right_padded`: the forward is (R, T), rows from position 0 (padded_forward)."""
        self.decode, self.layout, self.pool, self.writer, self.cache = decode, layout, pool, writer, cache
        self.right_padded = right_padded
        self.decode_mask = decode.mask() if decode is not None else None  # (D, 1, 1, span)
        # rows layout with known keys: each row's hit, gathered by row (the shared layout gathers
        # layout.shared once)
        self.reads = [torch.tensor(r.reads, dtype=torch.long, device=layout.last.device)
                      for r in layout.rows] if layout.shared is None and layout.mask is not None else []
        self.keeping = [i for i, r in enumerate(layout.rows) if r.staging is not None or r.slot is not None]
        self.plain = (decode is None and writer is None and layout.shared is None and layout.gather is None
                      and layout.mask is None and not self.keeping)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("StepStore attends by itself (attention)")

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, D + P, hs) -> y (1, nh, D + P, hs); right-padded, (R, nh, T, hs) each."""
        if self.writer is not None:
            self.writer.write(layer, k, v)
        if self.right_padded:  # each row causal over its own tokens; a real one never sees padding
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (R, nh, T, hs)
        D = self.layout.decode_rows
        q0, k0, v0 = q[0], k[0], v[0]  # (nh, N, hs) each
        nh, N, hs = q0.shape
        y = torch.empty_like(q0)  # (nh, N, hs)
        if D:
            qd, kd, vd = (x[:, :D].transpose(0, 1)[:, :, None].contiguous() for x in (q0, k0, v0))  # (D, nh, 1, hs)
            yd = self.decode.attention(layer, qd, kd, vd)  # (D, nh, 1, hs), the compiled kernel on a CPU
            if yd is None:
                keys, values = self.decode.attend(layer, kd, vd)  # (D, nh, span, hs)
                yd = F.scaled_dot_product_attention(qd, keys, values, attn_mask=self.decode_mask)
            y[:, :D] = yd[:, :, 0].transpose(0, 1)  # (nh, D, hs)
        if not self.layout.rows:
            return y[None]
        if self.layout.shared is not None:
            self._stage(layer, lambda i: (k0[:, self.layout.own(i)], v0[:, self.layout.own(i)]))
            keys, values = k0[:, D:], v0[:, D:]  # (nh, P, hs)
            if len(self.layout.shared):  # the distinct known positions in front: (nh, U + P, hs)
                keys, values = (torch.cat([x[layer].index_select(0, self.layout.shared).transpose(0, 1), own], dim=1)
                                for x, own in ((self.pool.keys, keys), (self.pool.values, values)))
            y[:, D:] = F.scaled_dot_product_attention(q0[None, :, D:], keys[None], values[None],
                                                      attn_mask=self.layout.mask)[0]  # (nh, P, hs)
            return y[None]
        R, T = self.layout.padded
        gather = self.layout.gather
        qr, kr, vr = ((x[:, D:] if gather is None else x[:, gather]).view(nh, R, T, hs).transpose(0, 1)
                      for x in (q0, k0, v0))  # (R, nh, T, hs)
        self._stage(layer, lambda i: (kr[i, :, :len(self.layout.rows[i].tokens)], vr[i, :, :len(self.layout.rows[i].tokens)]))
        if self.layout.mask is None:
            yr = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)  # (R, nh, T, hs)
        else:
            known_k, known_v = self._known(layer, kr)  # (R, nh, K, hs) each
            keys, values = torch.cat([known_k, kr], dim=2), torch.cat([known_v, vr], dim=2)  # (R, nh, K + T, hs)
            yr = F.scaled_dot_product_attention(qr, keys, values, attn_mask=self.layout.mask)  # (R, nh, T, hs)
        yr = yr.transpose(0, 1).reshape(nh, R * T, hs)
        if not D and self.layout.real is None:  # the padded rows are the packed row
            return yr[None]
        y[:, D:] = yr if self.layout.real is None else yr[:, self.layout.real]  # (nh, P, hs)
        return y[None]  # (1, nh, N, hs)

    def _stage(self, layer: int, own: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This step's keys and values (`own(i)`: row i's, (nh, n, hs) each) of rows that keep them:
        a chunked prompt's into its staging, a new sequence's into its cache slot (a chunked
        prompt's last chunk: both)."""
        for i in self.keeping:
            row, (k, v) = self.layout.rows[i], own(i)
            kept = [tuple(x[0] for x in row.staging.staging(layer, k[None]))] if row.staging is not None else []
            if row.slot is not None:
                kept.append((self.cache.keys[layer, row.slot], self.cache.values[layer, row.slot]))
            for keys, values in kept:  # (nh, L, hs) each
                keys[:, row.start:row.stop] = k
                values[:, row.start:row.stop] = v

    def _known(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values before its first computed position, left-aligned and
        zero-padded (the mask hides the padding): (R, nh, K, hs) each."""
        R, nh, _, hs = like.shape
        K = self.layout.known
        known_k = torch.zeros(R, nh, K, hs, dtype=like.dtype, device=like.device)
        known_v = torch.zeros_like(known_k)
        for i, row in enumerate(self.layout.rows):
            if row.staging is not None and row.start:
                keys, values = row.staging.staging(layer, like)  # (1, nh, L, hs) each
                known_k[i, :, :row.start] = keys[0, :, :row.start]
                known_v[i, :, :row.start] = values[0, :, :row.start]
            elif len(self.reads[i]):
                c = len(self.reads[i])
                known_k[i, :, :c] = self.pool.keys[layer].index_select(0, self.reads[i]).transpose(0, 1)  # (nh, c, hs)
                known_v[i, :, :c] = self.pool.values[layer].index_select(0, self.reads[i]).transpose(0, 1)
        return known_k, known_v


def packed_inputs(decode_ids: torch.Tensor, decode_positions: Sequence[int], layout: StepLayout,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(D,) decode tokens at their positions, then every row's tokens at theirs -> ids and
    positions (1, N) each."""
    rows = layout.rows
    prompt_ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long, device=device)  # (P,)
    positions = [*decode_positions, *(p for r in rows for p in range(r.start, r.stop))]
    ids = torch.cat((decode_ids, prompt_ids))[None]  # (1, N)
    return ids, torch.tensor(positions, dtype=torch.long, device=device)[None]  # (1, N) each


def packed_forward(model, decode: SlotStore | None, decode_ids: torch.Tensor, decode_positions: Sequence[int],
                   rows: Sequence[PromptRow], pool: PrefixCache | None = None, plans: Sequence = (),
                   cache: KVCache | None = None, pack: bool = False,
                   decode_adapters: Sequence[LoraAdapter | None] = ()) -> tuple[torch.Tensor, StepLayout]:
    """One forward of D decode tokens ((D,) ids at their positions, attending over slots 0..D-1
    through `decode`) and the prompt rows -> ((1, N, C) residual stream, the layout). The first
    len(plans) rows are prompts planned by the prefix cache (prefix_cache.RowPlan): their new
    full blocks go into `pool`, their hidden rows included; rows with a slot write into `cache`.
    `pack`: the shared layout where it is cheaper (then the caller runs again in rows where
    layout.needs_rows_again). `decode_adapters`: each decode token's LoRA adapter (empty: none)."""
    device = decode_ids.device
    layout = StepLayout.of(len(decode_ids), rows, device, pack)
    adapters = AdapterRows.of([*(decode_adapters or [None] * len(decode_ids)), *(r.adapter for r in rows)],
                              [*[1] * len(decode_ids), *(len(r.tokens) for r in rows)], device)
    writer = None
    if pool is not None and any(plan.new for plan in plans):  # new blocks start where the hit ends
        writer = BlockWriter.for_rows(pool, plans, layout.firsts[:len(plans)], [0] * len(plans))
    ids, positions = packed_inputs(decode_ids, decode_positions, layout, device)
    store = StepStore(decode, layout, pool, writer, cache)
    if store.plain:  # rows of one length that read and keep nothing: the same forward, one row each
        R, T = layout.padded
        return model.hidden_states(ids.view(R, T), positions.view(R, T), None,
                                   adapters=adapters).view(1, R * T, -1), layout
    hidden = model.hidden_states(ids, positions, None, kv=store, adapters=adapters)  # (1, N, C)
    if writer is not None:
        writer.write_hidden(hidden)
    return hidden, layout


def padded_forward(model, prompts: Sequence[Sequence[int]], ids: torch.Tensor, pool: PrefixCache | None = None,
                   plans: Sequence[RowPlan] = (), taps=None, adapters: Sequence[LoraAdapter | None] = ()) -> torch.Tensor:
    """Whole prompts, right-padded into (R, T) `ids` (padding.right_padded), in one forward, each row
    attending causally over its own tokens, with introspection's `taps` (engine.gpt2.ForwardTaps)
    -> (R, T, C) residual stream. Each plan's new full blocks go into `pool` (no hit is read:
    every position is computed). `adapters`: each row's LoRA adapter (empty: none)."""
    R, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(R, T)  # (R, T)
    store = None
    if pool is not None and any(plan.new for plan in plans):  # a row's blocks lie from its column 0
        layout = StepLayout.of(0, [PromptRow(p) for p in prompts], ids.device)
        store = StepStore(None, layout, pool, BlockWriter.for_rows(pool, plans, [0] * R), right_padded=True)
    hidden = model.hidden_states(ids, positions, None, taps=taps, kv=store,
                                 adapters=AdapterRows.of(adapters, T, ids.device))  # (R, T, C)
    if store is not None:
        store.writer.write_hidden(hidden)
    return hidden


def prompt_forward(model, rows: Sequence[PromptRow], pool: PrefixCache | None, plans: Sequence[RowPlan],
                   pack: bool = True) -> tuple[torch.Tensor, StepLayout]:
    """packed_forward of next-token prompt rows alone (no decode tokens, no slots)."""
    no_decode = torch.zeros(0, dtype=torch.long, device=model.wpe.weight.device)
    return packed_forward(model, None, no_decode, (), rows, pool, plans, pack=pack)


def prompt_scores(hidden: torch.Tensor, layout: StepLayout, pool: PrefixCache | None, scored_rows: dict[int, int],
                  head, vocab_size: int) -> dict[int, PromptScores]:
    """Every position of the scored rows (row -> top-k; engine.head), cached ones included: each
    row's residual stream over its whole prompt, the cached positions' from the pool."""
    if not scored_rows:
        return {}
    streams, ids, spans, start = [], [], [], 0
    for i, k in scored_rows.items():
        row = layout.rows[i]
        cached = pool.hidden.index_select(0, torch.as_tensor(row.reads, dtype=torch.long, device=pool.device)) \
            if row.start else hidden[0, :0]
        streams.append(torch.cat([cached, hidden[0, layout.own(i)]]))  # (L, C)
        ids += row.prompt[:row.stop]
        spans.append(ScoredSpan(0, start, row.stop, k))
        start += row.stop
    ids_t = torch.tensor(ids, dtype=torch.long, device=hidden.device)[None]  # (1, sum L)
    return dict(zip(scored_rows, score_prompts(torch.cat(streams)[None], ids_t, spans, head, vocab_size)))
