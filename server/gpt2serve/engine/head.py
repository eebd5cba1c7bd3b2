"""The LM head's outputs read back: the last position's top-k of every row (top_k_rows, what a
next-token answer carries), and every position of a prompt, for scoring it (score_prompts): each
position's distribution over the vocabulary is reduced, as soon as it exists, to what the
caller asked for.

A prompt of L tokens has L-1 scored positions: the hidden state at position i predicts token
i+1; token 0 has nothing before it, so it has no log-probability. Running ln_f + lm_head over
all positions at once would hold (N, V) logits: 64 prompts of 1,024 tokens are 13 GB in fp32.
So the scored positions go through the head in chunks of at most `chunk_rows(V)` rows, and a
chunk leaves only, per position, the actual token's log-probability, its rank and the top-k
(values and ids): (N, 2 + 2k) floats in all, copied to the host once.

Rank is 1 + the number of tokens strictly more likely than the actual one (vLLM's rank), so
the model's own choice has rank 1.

Extra peak memory while scoring: one chunk's gathered hidden rows (chunk, C) and a few
(chunk, V) tensors (logits, fp32 log-softmax, the comparison for the rank), bounded by
HEAD_CHUNK_BYTES whatever the batch; measured in bench/serving/scoring.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..protocol import PromptScores, TopTable

# What one chunk may take, all its (chunk, V) tensors together; see chunk_rows.
HEAD_CHUNK_BYTES = 192 * 2**20
# (chunk, V) tensors alive at once in a chunk's peak: logits, fp32 log-softmax, and the boolean
# "more likely" comparison (1 byte a cell, counted as a full one to keep the bound simple).
LIVE_VOCAB_TENSORS = 3


def chunk_rows(vocab_size: int, budget_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Positions per head chunk: GPT-2's 50,257 tokens give 333 (about 64 MiB a tensor)."""
    return max(1, budget_bytes // (LIVE_VOCAB_TENSORS * 4 * vocab_size))


@dataclass(frozen=True)
class ScoredSpan:
    """Where one prompt sits in a (B, T) batch: its row, first column and length."""

    row: int
    start: int
    length: int
    top_k: int  # alternatives wanted per position (0: the actual token's log-probability and rank)


def score_prompts(hidden: torch.Tensor, input_ids: torch.Tensor, spans: Sequence[ScoredSpan],
                  head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                  chunk: int | None = None) -> list[PromptScores]:
    """hidden (B, T, C) residual stream after the last block (before ln_f), input_ids (B, T) ->
    one PromptScores per span. `head` maps (N, C) rows to (N, V) logits (ln_f + lm_head);
    `chunk`: positions per head call (default: chunk_rows)."""
    device = hidden.device
    lengths = torch.tensor([s.length - 1 for s in spans])  # (P,) scored positions per prompt
    rows = torch.repeat_interleave(torch.tensor([s.row for s in spans]), lengths)  # (N,)
    starts = torch.repeat_interleave(torch.tensor([s.start for s in spans]), lengths)  # (N,)
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)  # (N,)
    positions = starts + within  # (N,) the column whose hidden state predicts the next column's token
    rows, positions = rows.to(device), positions.to(device)
    targets = input_ids[rows, positions + 1]  # (N,)
    k = max((s.top_k for s in spans), default=0)
    n, step = rows.numel(), chunk or chunk_rows(vocab_size)
    out = torch.empty(n, 2 + 2 * k, dtype=torch.float32, device=device)  # (N, 2 + 2k) what the host gets
    for first in range(0, n, step):
        part = slice(first, min(first + step, n))
        logprobs = torch.log_softmax(head(hidden[rows[part], positions[part]]).float(), dim=-1)  # (n', V)
        actual = logprobs.gather(1, targets[part, None])  # (n', 1)
        out[part, 0] = actual[:, 0]
        out[part, 1] = (logprobs > actual).sum(dim=-1).float() + 1  # rank, exact in float32 below 2**24
        if k:
            values, ids = torch.topk(logprobs, k, dim=-1)  # (n', k) each
            out[part, 2:2 + k] = values
            out[part, 2 + k:] = ids.float()
    table = out.cpu()  # one copy to the host
    results, first = [], 0
    for span, count in zip(spans, lengths.tolist()):
        block = table[first:first + count]
        first += count
        kk = span.top_k
        results.append(PromptScores(block[:, 0].tolist(), block[:, 1].int().tolist(),
                                    block[:, 2 + k:2 + k + kk].int().tolist(), block[:, 2:2 + kk].tolist()))
    return results


def top_k_rows(logprobs: torch.Tensor, top_ks: Sequence[int]) -> tuple[TopTable, frozenset[int]]:
    """(B, V) log-probs of each row's next token -> each row's top-k (read_top_k), with one
    device-to-host copy: values and ids travel as one tensor (ids are exact in float32 below 2**24)."""
    return read_top_k(top_k_table(logprobs, top_ks).cpu(), top_ks)  # one copy


def top_k_table(logprobs: torch.Tensor, top_ks: Sequence[int]) -> torch.Tensor:
    """(B, V) log-probs -> (2, B, k_max) on their device: the best values and their ids, one
    tensor for one copy to the host (ids are exact in float32 below 2**24)."""
    values, ids = torch.topk(logprobs, k=max(top_ks), dim=-1)  # (B, k_max) each
    return torch.stack((values, ids.float()))


def read_top_k(both: torch.Tensor, top_ks: Sequence[int]) -> tuple[TopTable, frozenset[int]]:
    """(2, B, k_max) values and ids on the host -> each row's top-k (a TopTable: read into lists
    only if a row is read), and the rows that are not finite: any NaN or +inf logit makes
    log_softmax NaN across the row, so its best value tells."""
    table = TopTable(both.numpy(), top_ks)  # shares `both`'s memory, and keeps it
    return table, table.failed_rows()
