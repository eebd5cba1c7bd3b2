"""Keys and values of the running sequences, kept on the device between generation steps.

One slot per sequence, each as long as the context, in two tensors per cache (keys, values):
(n_layer, slots, nh, L, hs). Slots stay dense: the n running sequences always hold slots
0..n-1 (a leaving sequence's slot takes the last one's contents), so a decode step attends over
a view of the first n slots and never gathers a copy, and new sequences join at n, n+1, ...

Every value read is finite: the tensors start zeroed, and a slot past a sequence's length holds
zeros or an earlier sequence's keys, which the mask hides (a NaN there would leak through
attention's weights @ values even at weight 0).
"""

from __future__ import annotations

import torch

from .gpt2 import GPT2Config


class KVCache:
    def __init__(self, config: GPT2Config, slots: int, device: torch.device, dtype: torch.dtype):
        shape = (config.n_layer, slots, config.n_head, config.n_ctx, config.d_head)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (n_layer, slots, nh, L, hs)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.slots, self.length = slots, config.n_ctx
        self._rows = torch.arange(slots, device=device)  # (slots,)

    @staticmethod
    def bytes_per_slot(config: GPT2Config, dtype: torch.dtype) -> int:
        """Keys and values of one full-context sequence."""
        return 2 * config.n_layer * config.n_ctx * config.d_model * torch.finfo(dtype).bits // 8

    def move(self, source: int, target: int, length: int) -> None:
        """Slot `source`'s first `length` positions into slot `target` (compaction)."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def prefill(self, first_slot: int) -> PrefillStore:
        return PrefillStore(self, first_slot)

    def decode(self, positions: torch.Tensor, span: int) -> DecodeStore:
        return DecodeStore(self, positions, span)


class PrefillStore:
    """Prompts right-padded into (B, T), written to slots first_slot..first_slot+B-1 at positions
    0..T-1; attention stays within the prompt (the mask hides the padding, which sits after
    every real token, so no real query sees it)."""

    def __init__(self, cache: KVCache, first_slot: int):
        self.cache, self.first_slot = cache, first_slot

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, _, T, _ = k.shape  # (B, nh, T, hs)
        slots = slice(self.first_slot, self.first_slot + B)
        self.cache.keys[layer, slots, :, :T] = k
        self.cache.values[layer, slots, :, :T] = v
        return k, v


class DecodeStore:
    """One new token for each of slots 0..B-1, at `positions` (B,): written there, then attended
    together with the first `span` positions of its slot (span > every position; the mask
    hides what lies past each row's own position)."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int):
        self.cache, self.positions, self.span = cache, positions, span

    def mask(self) -> torch.Tensor:
        """(B, 1, 1, span) bool: key j is visible to row b iff j <= positions[b]."""
        keys = torch.arange(self.span, device=self.positions.device)  # (span,)
        return (keys[None, :] <= self.positions[:, None])[:, None, None, :]

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]  # k, v: (B, nh, 1, hs)
        rows = self.cache._rows[:B]
        # Advanced indices on dims 0 and 2 around a slice: the target is (B, nh, hs).
        self.cache.keys[layer, rows, :, self.positions] = k[:, :, 0]
        self.cache.values[layer, rows, :, self.positions] = v[:, :, 0]
        span = slice(0, self.span)
        return self.cache.keys[layer, :B, :, span], self.cache.values[layer, :B, :, span]  # (B, nh, span, hs)
