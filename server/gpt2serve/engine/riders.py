"""Next-token prompts that ride a decode step: one forward for both.

A decode step of D running sequences and R waiting next-token prompts (riders) runs as one row
of D + P packed tokens: the D decode tokens (sequence i in cache slot i, at its own position),
then each rider's prompt. Every matrix of the model (QKV, projections, MLP, head) reads its
weights once for all of them, which on a CPU, where a small step costs a pass over the weights,
is most of the step; only attention goes its own way per kind (`RiderStore`):
- decode tokens attend over their slots, as a decode step does (kv_cache.DecodeStore: the
  compiled CPU kernel, or SDPA over the span);
- riders attend over their own prompts only: gathered into right-padded rows (R, nh, T, hs) with
  a causal mask, so a real token never sees padding, and a rider's numbers (a NaN included)
  never reach another rider or a decode row. Riders write nothing into the cache.

Riders are next-token prompts the step can answer whole: untraced, unscored, and with nothing
for the prefix cache (scheduling.core decides). On cuda with decode graphs, a step with riders
would run eagerly (launch-bound, several times a graph replay), so there riders take their own
forward beside the step instead (`Generator.takes_riders`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .kv_cache import DecodeStore


@dataclass(frozen=True)
class RiderLayout:
    """Where each rider's tokens sit in the packed row, and their right-padded rows."""

    decode_rows: int  # D: the decode tokens come first
    lengths: list[int]
    gather: torch.Tensor  # (R * T,): packed index of each padded (rider, column); padding -> its rider's last token
    real: torch.Tensor  # (P,): index into the (R * T) padded tokens of each packed rider token, in packed order
    last: torch.Tensor  # (R,): packed index of each rider's last token

    @classmethod
    def of(cls, decode_rows: int, prompts: Sequence[Sequence[int]], device: torch.device) -> RiderLayout:
        lengths = [len(p) for p in prompts]
        T = max(lengths)
        gather, real, last, start = [], [], [], decode_rows
        for r, length in enumerate(lengths):
            gather += [start + min(t, length - 1) for t in range(T)]
            real += [r * T + t for t in range(length)]
            start += length
            last.append(start - 1)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(decode_rows, lengths, as_tensor(gather), as_tensor(real), as_tensor(last))

    @property
    def padded(self) -> tuple[int, int]:
        return len(self.lengths), max(self.lengths)


class RiderStore:
    """The KeyValueStore (engine.gpt2) of a decode step with riders: it attends by itself."""

    def __init__(self, decode: DecodeStore, layout: RiderLayout):
        self.decode, self.layout = decode, layout
        self.decode_mask = decode.mask()  # (D, 1, 1, span)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("RiderStore attends by itself (attention)")

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (1, nh, D + P, hs) -> y (1, nh, D + P, hs)."""
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
        R, T = self.layout.padded
        qr, kr, vr = (x[:, self.layout.gather].view(nh, R, T, hs).transpose(0, 1) for x in (q0, k0, v0))  # (R, nh, T, hs)
        yr = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)  # (R, nh, T, hs): right-padded rows
        y[:, D:] = yr.transpose(0, 1).reshape(nh, R * T, hs)[:, self.layout.real]  # (nh, P, hs)
        return y[None]  # (1, nh, N, hs)
