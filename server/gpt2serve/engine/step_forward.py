"""One forward for every row of a step (vLLM's mixed batches): D decode tokens, then prompt rows,
laid end to end as one row of N tokens. A prompt row is a next-token prompt answered from the
step (a "rider"), a new generation's prompt read into its cache slot (a "joining" one), or a
long prompt's next chunk (engine.chunked_prefill).

Every matrix of the model (QKV, projections, MLP, head) reads its weights once for all of them,
which on a CPU, where a small step costs a pass over the weights, is most of the step; only
attention goes its own way per kind (`StepStore`):
- decode tokens attend over their slots, as a decode step does (kv_cache.DecodeStore: the
  compiled CPU kernel, or SDPA over the span);
- a prompt row computes positions [start, end) of its prompt and attends over what is known
  before `start`, then over its own tokens causally. What is known comes from the prefix cache
  (its hit blocks, gathered from the pool) or, for a chunked prompt, from its staging
  (engine.chunked_prefill), where its own keys and values go too. Rows are gathered into
  right-padded (R, nh, T, hs) with a mask, so a real query never sees padding, and a row's
  numbers (a NaN included) never reach another row or a decode token.
Prompt rows take no KV-cache slot; their new full blocks go into the prefix cache (`writer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .kv_cache import DecodeStore, KVCache
from .prefix_cache import PrefixCache
from .prefix_forward import BlockWriter


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

    @property
    def stop(self) -> int:
        return len(self.prompt) if self.end is None else self.end

    @property
    def tokens(self) -> Sequence[int]:
        return self.prompt[self.start:self.stop]


@dataclass(frozen=True)
class StepLayout:
    """Where each prompt row's tokens sit in the packed row, and their right-padded rows."""

    decode_rows: int  # D: the decode tokens come first
    rows: Sequence[PromptRow]
    firsts: list[int]  # packed index of each row's first token
    gather: torch.Tensor  # (R * T,): packed index of each padded (row, column); padding -> its row's last token
    real: torch.Tensor  # (P,): index into the (R * T) padded tokens of each packed row token, in packed order
    last: torch.Tensor  # (R,): packed index of each row's last token
    mask: torch.Tensor | None  # (R, 1, T, K + T): known keys, then own; None when nothing is known (causal)

    @classmethod
    def of(cls, decode_rows: int, rows: Sequence[PromptRow], device: torch.device) -> StepLayout:
        lengths = [len(r.tokens) for r in rows]
        T, K = max(lengths, default=1), max((r.start for r in rows), default=0)
        gather, real, last, firsts, first = [], [], [], [], decode_rows
        for r, length in enumerate(lengths):
            gather += [first + min(t, length - 1) for t in range(T)]
            real += [r * T + t for t in range(length)]
            firsts.append(first)
            first += length
            last.append(first - 1)
        mask = None
        if K:
            known = torch.tensor([r.start for r in rows])[:, None] > torch.arange(K)[None, :]  # (R, K)
            own = torch.tensor(lengths)[:, None] > torch.arange(T)[None, :]  # (R, T): real keys
            causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T); a padding query sees real keys
            mask = torch.cat([known[:, None, :].expand(-1, T, -1), causal[None] & own[:, None, :]], dim=2)[:, None]
            mask = mask.to(device)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(decode_rows, rows, firsts, as_tensor(gather), as_tensor(real), as_tensor(last), mask)

    @property
    def padded(self) -> tuple[int, int]:
        return len(self.rows), max(len(r.tokens) for r in self.rows)

    @property
    def known(self) -> int:
        """K: the most positions any row reads before its own."""
        return self.mask.shape[-1] - self.padded[1] if self.mask is not None else 0


class StepStore:
    """The KeyValueStore (engine.gpt2) of a packed step: it attends by itself."""

    def __init__(self, decode: DecodeStore | None, layout: StepLayout, pool: PrefixCache | None = None,
                 writer: BlockWriter | None = None, cache: KVCache | None = None):
        """`writer`: over the packed row, for the rows' new blocks; `cache`: where rows with a slot write."""
        self.decode, self.layout, self.pool, self.writer, self.cache = decode, layout, pool, writer, cache
        self.decode_mask = decode.mask() if decode is not None else None  # (D, 1, 1, span)
        self.reads = [torch.tensor(r.reads, dtype=torch.long, device=layout.gather.device) for r in layout.rows]

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("StepStore attends by itself (attention)")

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, D + P, hs) -> y (1, nh, D + P, hs)."""
        if self.writer is not None:
            self.writer.write(layer, k, v)
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
        if self.layout.rows:
            R, T = self.layout.padded
            qr, kr, vr = (x[:, self.layout.gather].view(nh, R, T, hs).transpose(0, 1) for x in (q0, k0, v0))  # (R, nh, T, hs)
            self._stage(layer, kr, vr)
            if self.layout.mask is None:
                yr = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)  # (R, nh, T, hs)
            else:
                known_k, known_v = self._known(layer, kr)  # (R, nh, K, hs) each
                keys, values = torch.cat([known_k, kr], dim=2), torch.cat([known_v, vr], dim=2)  # (R, nh, K + T, hs)
                yr = F.scaled_dot_product_attention(qr, keys, values, attn_mask=self.layout.mask)  # (R, nh, T, hs)
            y[:, D:] = yr.transpose(0, 1).reshape(nh, R * T, hs)[:, self.layout.real]  # (nh, P, hs)
        return y[None]  # (1, nh, N, hs)

    def _stage(self, layer: int, kr: torch.Tensor, vr: torch.Tensor) -> None:
        """This step's keys and values of rows that keep them: a chunked prompt's into its staging,
        a new sequence's into its cache slot (a chunked prompt's last chunk: both)."""
        for i, row in enumerate(self.layout.rows):
            kept = [tuple(x[0] for x in row.staging.staging(layer, kr))] if row.staging is not None else []
            if row.slot is not None:
                kept.append((self.cache.keys[layer, row.slot], self.cache.values[layer, row.slot]))
            n = row.stop - row.start
            for keys, values in kept:  # (nh, L, hs) each
                keys[:, row.start:row.stop] = kr[i, :, :n]
                values[:, row.start:row.stop] = vr[i, :, :n]

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


def packed_forward(model, decode: DecodeStore | None, decode_ids: torch.Tensor, decode_positions: Sequence[int],
                   rows: Sequence[PromptRow], pool: PrefixCache | None = None, plans: Sequence = (),
                   cache: KVCache | None = None) -> tuple[torch.Tensor, StepLayout]:
    """One forward of D decode tokens ((D,) ids at their positions, attending over slots 0..D-1
    through `decode`) and the prompt rows -> ((1, N, C) residual stream, the layout). The first
    len(plans) rows are prompts planned by the prefix cache (prefix_cache.RowPlan): their new
    full blocks go into `pool`, their hidden rows included; rows with a slot write into `cache`."""
    device = decode_ids.device
    layout = StepLayout.of(len(decode_ids), rows, device)
    writer = None
    if pool is not None and any(plan.new for plan in plans):  # new blocks start where the hit ends
        writer = BlockWriter.for_rows(pool, plans, layout.firsts[:len(plans)], [0] * len(plans))
    ids, positions = packed_inputs(decode_ids, decode_positions, layout, device)
    hidden = model.hidden_states(ids, positions, None, kv=StepStore(decode, layout, pool, writer, cache))  # (1, N, C)
    if writer is not None:
        writer.write_hidden(hidden)
    return hidden, layout
