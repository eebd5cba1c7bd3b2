"""Keys and values of the running sequences, kept on the device between generation steps.

Two tensors (keys, values) of (n_layer, S, nh, L, hs): S slots of L positions, one slot per
running sequence. Slots stay dense: the n running sequences always hold slots 0..n-1 (a leaving
sequence's slot takes the last one's contents), so a decode step attends over a view of the
first n slots and never gathers a copy, and new sequences join at n, n+1, ...

Memory follows what is held, in blocks of BLOCK positions of one slot:
- on a CPU the tensors grow when a step needs more slots or positions (to the next power of two,
  so a sequence growing to L tokens is copied O(log L) times, not L / BLOCK times) and shrink once
  they are more than twice what the running sequences need;
- on cuda they are claimed whole at start: captured CUDA graphs hold their addresses (as vLLM
  claims its block pool up front).
What may be held is bounded by `capacity_blocks` (--kv-cache-mb): the scheduler admits a sequence
only when every running sequence, at the longest length any of them may reach (prompt +
max_tokens), fits in it (`blocks_needed`). Dense slots cost a short sequence beside a long one as
much as the long one; paging (vLLM) would not, but would gather every key each decode step,
which on a CPU costs as much memory traffic as the attention itself.

Every value read is finite: the tensors start zeroed, and a slot past a sequence's length holds
zeros or an earlier sequence's keys, which the mask hides (a NaN there would leak through
attention's weights @ values even at weight 0); a sequence whose numbers were not finite has its
slot cleared as it leaves (engine.generator).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import native
from .gpt2 import GPT2Config

BLOCK = 64  # positions: the unit of growth and of admission


def blocks_for(length: int) -> int:
    return -(-length // BLOCK)


def blocks_needed(sequences: int, longest: int) -> int:
    """What `sequences` dense slots of `longest` positions take, in blocks."""
    return sequences * blocks_for(longest)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class KVCache:
    def __init__(self, config: GPT2Config, slots: int, capacity_blocks: int, device: torch.device,
                 dtype: torch.dtype, grow: bool):
        """`slots`: sequences at most; `capacity_blocks`: what may be held; `grow`: allocate as
        steps need (else all of slots x n_ctx now, which must fit in the capacity)."""
        self.config, self.device, self.dtype, self.grow = config, device, dtype, grow
        self.max_slots, self.capacity_blocks = slots, capacity_blocks
        self.slots, self.length = 0, 0
        self.keys = self.values = torch.empty(0)
        if grow:
            self._resize(1, min(BLOCK, config.n_ctx))
        else:
            assert blocks_needed(slots, config.n_ctx) <= capacity_blocks, "the whole cache must fit its capacity"
            self._resize(slots, config.n_ctx)

    @staticmethod
    def bytes_per_token(config: GPT2Config, dtype: torch.dtype) -> int:
        """Keys and values of one position, every layer."""
        return 2 * config.n_layer * config.d_model * torch.finfo(dtype).bits // 8

    def reserve(self, sequences: int, length: int) -> None:
        """Room for `sequences` slots of `length` positions (growing: up to a power of two,
        within the capacity, which admission keeps the exact size within)."""
        if sequences <= self.slots and length <= self.length:
            return
        assert self.grow, f"{sequences} x {length} positions do not fit a cache of {self.slots} x {self.length}"
        slots, length = max(sequences, self.slots), max(length, self.length)
        rounded_slots, rounded_length = min(_power_of_two_at_least(slots), self.max_slots), self._rounded(length)
        if blocks_needed(rounded_slots, rounded_length) <= self.capacity_blocks:
            slots, length = rounded_slots, rounded_length
        else:
            length = self._whole_blocks(length)
        self._resize(slots, length)

    def _rounded(self, length: int) -> int:
        """`length` positions rounded up to a power of two of blocks (at most the context)."""
        return min(BLOCK * _power_of_two_at_least(blocks_for(length)), self.config.n_ctx)

    def _whole_blocks(self, length: int) -> int:
        """`length` positions rounded up to whole blocks (at most the context)."""
        return min(BLOCK * blocks_for(length), self.config.n_ctx)

    def span_for(self, sequences: int, needed: int) -> int:
        """Positions a decode step of `sequences` attends over, `needed` of them in use: a power of
        two of blocks where the capacity allows (few distinct shapes, see engine.traced_decode),
        else `needed` rounded up to a block."""
        span = self._rounded(needed)
        return span if blocks_needed(sequences, span) <= self.capacity_blocks else self._whole_blocks(needed)

    def eager_span(self, sequences: int, needed: int) -> int:
        """Room for `sequences` slots of `needed` positions; the span an eager step attends over:
        whole blocks, for fewer distinct shapes."""
        self.reserve(sequences, needed)
        return min(self._whole_blocks(needed), self.length)

    def fit(self, sequences: int, length: int) -> None:
        """Shrink once the tensors are more than twice what `sequences` x `length` needs."""
        if not self.grow:
            return
        slots = max(_power_of_two_at_least(sequences), 1)
        length = self._rounded(max(length, 1))
        if self.slots >= 2 * slots or self.length >= 2 * length:
            self._resize(min(slots, self.slots), min(length, self.length))

    def _resize(self, slots: int, length: int) -> None:
        c = self.config
        shape = (c.n_layer, slots, c.n_head, length, c.d_head)
        keys = torch.zeros(shape, device=self.device, dtype=self.dtype)  # (n_layer, S, nh, L, hs)
        values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        kept_slots, kept_length = min(slots, self.slots), min(length, self.length)
        if kept_slots and kept_length:
            keys[:, :kept_slots, :, :kept_length] = self.keys[:, :kept_slots, :, :kept_length]
            values[:, :kept_slots, :, :kept_length] = self.values[:, :kept_slots, :, :kept_length]
        self.keys, self.values, self.slots, self.length = keys, values, slots, length

    def clear(self, slot: int, length: int) -> None:
        """Zero a slot's first `length` positions (those of a sequence whose numbers were not finite)."""
        length = min(length, self.length)
        self.keys[:, slot, :, :length] = 0
        self.values[:, slot, :, :length] = 0

    def copy_in(self, slot: int, keys: torch.Tensor, values: torch.Tensor,
                positions: Sequence[int] | torch.Tensor) -> None:
        """Every layer's keys and values at `positions` of (n_layer, P, nh, hs) `keys`, `values`
        (the prefix cache's pool) into the first positions of `slot`."""
        at = torch.as_tensor(positions, dtype=torch.long, device=keys.device)  # (c,)
        self.keys[:, slot, :, :len(at)] = keys[:, at].transpose(1, 2)  # (n_layer, nh, c, hs)
        self.values[:, slot, :, :len(at)] = values[:, at].transpose(1, 2)

    def move(self, source: int, target: int, length: int) -> None:
        """Slot `source`'s first `length` positions into slot `target` (compaction)."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]


class SlotStore:
    """The KeyValueStore (engine.gpt2) of a forward whose rows each own a slot: row b's T new
    tokens are written at `positions` (B, T) of slot `slots[b]`, then attended together with the
    first `span` positions of that slot. Two uses:
    - a decode step: one new token a row (positions (B,)), rows in slots 0..B-1 (`slots` None:
      a view of the first B slots, no copy), its keys behind it; `mask()` hides what lies past
      each row's own position (span > every position). What a decode graph captures;
    - a prefill of prompts from position 0, right-padded (positions (B, T) = 0..T-1, span T): the
      forward attends causally (no mask) over what it just wrote. Rows not `real` (B,) are
      padding: they write back what their target holds, so several of them may share a slot
      that a sequence holds. What a prefill graph captures (engine.cuda_graphs.PrefillGraphs)."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int, slots: torch.Tensor | None = None,
                 real: torch.Tensor | None = None):
        self.cache, self.positions, self.span, self.slots = cache, positions, span, slots
        self.real = real[:, None, None, None] if real is not None else None  # (B, 1, 1, 1)
        # On a CPU, the compiled decode attention reads each row's own positions, not the span.
        self.native = (positions.dim() == 1 and slots is None and cache.device.type == "cpu"
                       and cache.dtype in (torch.float32, torch.float16) and native.available())

    def mask(self) -> torch.Tensor:
        """(B, 1, T, span) bool: key j is visible to row b's query t iff j <= its position."""
        keys = torch.arange(self.span, device=self.positions.device)  # (span,)
        return (keys[None, None, :] <= self._rows_positions()[:, :, None])[:, None]

    def _rows_positions(self) -> torch.Tensor:
        """(B, T) positions. Indexed, not reshaped to len(positions): a traced decode step
        (engine.traced_decode) would keep that length as a constant for every batch size."""
        return self.positions if self.positions.dim() == 2 else self.positions[:, None]

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]  # k, v: (B, nh, T, hs); B from k's size, so a trace keeps it variable
        slots = self.slots if self.slots is not None else torch.arange(B, device=k.device)  # (B,)
        # Advanced indices on dims 0 and 2 around a slice: the target is (B, T, nh, hs).
        where = (layer, slots[:, None], slice(None), self._rows_positions())
        for cache, new in ((self.cache.keys, k), (self.cache.values, v)):
            new = new.transpose(1, 2).to(cache.dtype)
            cache[where] = new if self.real is None else torch.where(self.real, new, cache[where])
        span = slice(0, self.span)
        if self.slots is None:
            keys, values = self.cache.keys[layer, :B, :, span], self.cache.values[layer, :B, :, span]
        else:
            keys, values = self.cache.keys[layer, slots, :, span], self.cache.values[layer, slots, :, span]
        # (B, nh, span, hs): an fp16 cache (see Engine.kv_dtype) widened for attention
        return keys.to(k.dtype), values.to(v.dtype)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """q, k, v (B, nh, 1, hs) -> y (B, nh, 1, hs), k and v written into the cache first (CPU,
        fp32 or fp16, decode); None: through `attend`."""
        if not self.native:
            return None
        return torch.ops.gpt2serve.decode_attention(q, k, v, self.cache.keys[layer], self.cache.values[layer],
                                                    self.positions)
