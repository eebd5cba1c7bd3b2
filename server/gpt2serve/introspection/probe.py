"""Layer-by-layer reports for the traced rows of a batch, from what the forward computed.

The model calls the probe at its taps (engine.gpt2.ForwardTaps), and the probe keeps slices of
what each block already computes (its fused QKV projection, attention and MLP outputs, the
residual stream) for the traced rows only, so the answer is barely delayed. Afterwards
`reports()` reduces them on the device, all blocks at once, to a few numbers per head and per
layer. The attention probabilities of a traced row are rebuilt
from the model's own Q and K (softmax(QK^T / sqrt(d_head)) with the causal mask over the row's
real tokens), so every row, traced or not, keeps the fast SDPA kernel in the model itself.
Everything stays on the device until one host copy per statistic.

Layer timings: host clocks on CPU (where a kernel finishes before the tap runs); CUDA events on
a GPU, read once after the forward instead of a host sync per layer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import torch

from gpt2serve_client.types import HeadSummary, LayerReport, TokenProb

from ..telemetry.records import ForwardTimeline
from .walkthrough import ShapeRecorder



class TappedModel(Protocol):
    """What the probe reads of the model (engine.gpt2.GPT2, which calls the probe's taps)."""

    config: Any  # n_layer, n_head, n_embd

    def ln_f(self, hidden: torch.Tensor) -> torch.Tensor: ...

LOGIT_LENS_K = 5



@dataclass
class _Clock:
    """Marks points in the forward: host time on CPU, CUDA events on a GPU (converted at the end)."""

    device: torch.device
    marks: list = field(default_factory=list)

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.time_ns())

    def times_ns(self, end_ns: int) -> list[int]:
        """Every mark as wall-clock ns. CUDA events only give intervals, so they are anchored at
        `end_ns`, a host time taken just after the device reached the last mark (a sync)."""
        if self.device.type != "cuda":
            return list(self.marks)
        last = self.marks[-1]
        return [end_ns - round(mark.elapsed_time(last) * 1e6) for mark in self.marks]


class LayerProbe(ShapeRecorder):
    """The taps of one forward (engine.gpt2.ForwardTaps); `reports()` afterwards gives per-row
    layer summaries and the timeline, and the recorded shapes give the walk-through."""

    def __init__(self, model: TappedModel, rows: Sequence[int], lengths: Sequence[int], input_ids: torch.Tensor,
                 token_text: Callable[[int], str], mapped_rows: Sequence[int] = (), last_row_rows: Sequence[int] = (),
                 twins: dict[int, int] | None = None):
        super().__init__()
        self.model = model
        self.token_text = token_text
        self.rows = list(rows)
        self.lengths = list(lengths)  # real (unpadded) length of each traced row, from column 0
        self._ends = [length - 1 for length in self.lengths]  # each traced row's last real column
        self.mapped_rows = set(mapped_rows)  # traced rows that also want full attention maps and lens
        self.last_row_rows = set(last_row_rows)  # of those, rows that want each map's last query row alone
        self.twins = twins or {}  # compare_base: traced row -> its twin, the same prompt under the base
        self.input_ids = input_ids  # (B, T), right-padded
        self.n_head = model.config.n_head
        self.clock = _Clock(input_ids.device)
        # Kept at the taps (slices only, so the answer is not delayed); reduced after it.
        self._qkv: list[list[torch.Tensor]] = []  # per block, per traced row: (L, 3d)
        self._hidden_last: list[torch.Tensor] = []  # per block: (R, d) residual after the block
        self._attn_last: list[torch.Tensor] = []  # per block: (R, d)
        self._mlp_last: list[torch.Tensor] = []  # per block: (R, d)
        self._hidden_all: dict[int, list[torch.Tensor]] = {  # (L, d) per block: the all-position lens
            row: [] for row in self.mapped_rows - self.last_row_rows}
        self._end_ns = 0

    # Taps: slices of what the block computed, for the traced rows ----------------------------------

    def start(self) -> None:
        self.clock.mark()  # forward start

    def embedded(self, x: torch.Tensor) -> None:
        super().embedded(x)
        self.clock.mark()  # embedding end

    def qkv(self, layer: int, qkv: torch.Tensor) -> None:
        super().qkv(layer, qkv)
        self._qkv.append([qkv[row, :length] for row, length in zip(self.rows, self.lengths)])  # (L, 3d) each

    def block(self, layer: int, attn_out: torch.Tensor, mlp_out: torch.Tensor, hidden: torch.Tensor) -> None:
        super().block(layer, attn_out, mlp_out, hidden)
        self._attn_last.append(attn_out[self.rows, self._ends])  # (R, d)
        self._mlp_last.append(mlp_out[self.rows, self._ends])  # (R, d)
        self._hidden_last.append(hidden[self.rows, self._ends])  # (R, d)
        for row, length in zip(self.rows, self.lengths):
            if row in self._hidden_all:
                self._hidden_all[row].append(hidden[row, :length])  # (L, d): every real position
        self.clock.mark()  # block end

    # After the answers went out: reduce on the device, all blocks at once ---------------------------

    def _norms(self) -> torch.Tensor:
        """Residual, attention-output and MLP-output norms at the last position: (n_layer, R, 3)."""
        return torch.stack([torch.stack(captured).float().norm(dim=-1)
                            for captured in (self._hidden_last, self._attn_last, self._mlp_last)], dim=-1)

    def _attention(self, r: int, length: int) -> torch.Tensor:
        """Every block's attention probabilities for row r, from the model's own Q and K:
        (n_layer, H, L, L), query rows, key columns."""
        qkv = torch.stack([layer[r] for layer in self._qkv]).float()  # (n_layer, L, 3d)
        n_layer, d_model = qkv.shape[0], qkv.shape[-1] // 3
        d_head = d_model // self.n_head
        q, k, _ = qkv.split(d_model, dim=-1)  # each (n_layer, L, d)
        q = q.view(n_layer, length, self.n_head, d_head).transpose(1, 2)  # (n_layer, H, L, dh)
        k = k.view(n_layer, length, self.n_head, d_head).transpose(1, 2)  # (n_layer, H, L, dh)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d_head)  # (n_layer, H, L, L)
        causal = torch.ones(length, length, dtype=torch.bool, device=qkv.device).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # (n_layer, H, L, L)

    def _head_stats(self, r: int, length: int, probs: torch.Tensor) -> torch.Tensor:
        """Per block and head, from row r's attention probabilities (n_layer, H, L, L): (n_layer, 6, H)."""
        last = probs[..., -1, :]  # (n_layer, H, L): where the last position looks
        entropy = -(last * last.clamp_min(1e-30).log()).sum(dim=-1)  # (n_layer, H)
        max_weight, top_position = last.max(dim=-1)  # (n_layer, H)
        if length > 1:
            previous = probs.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=-1)  # (n_layer, H): mean p[i, i-1]
        else:
            previous = torch.zeros_like(entropy)
        top_token_id = self.input_ids[self.rows[r], :length][top_position]  # (n_layer, H)
        return torch.stack([entropy, max_weight, top_position.float(), top_token_id.float(), last[..., 0],
                            previous], dim=1)  # (n_layer, 6, H)

    def _maps(self, r: int, attention: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor]) -> list[dict]:
        """Per block, for row r: its attention maps [H*L*L] and the logit lens at every position.
        One unembedding a block (all blocks at once would hold n_layer * L * V logits), then one
        host copy per statistic. A last-row row: each map's last query row [H*L], no lens."""
        if self.rows[r] in self.last_row_rows:
            return [{"attention": row} for row in attention[..., -1, :].flatten(1).tolist()]  # (n_layer, H*L)
        best = [unembed(self.model.ln_f(hidden)).float().softmax(dim=-1).max(dim=-1)  # (L,) probs and ids
                for hidden in self._hidden_all[self.rows[r]]]  # (L, d) per block
        probs = torch.stack([p for p, _ in best]).tolist()  # (n_layer, L)
        ids = torch.stack([i for _, i in best]).tolist()  # (n_layer, L)
        maps = attention.flatten(1).tolist()  # (n_layer, H*L*L)
        return [{"attention": maps[layer],
                 "logit_lens_positions": [TokenProb(i, self.token_text(i), p) for i, p in zip(ids[layer], probs[layer])]}
                for layer in range(len(best))]

    def reports(self, unembed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[int, list[LayerReport]],
                                                                             ForwardTimeline]:
        """Per traced row, one LayerReport per block (a row with a twin: set beside the base's,
        `_beside_base`; the twins themselves are not reported); and the stage timeline.
        Call after `finish()`. `unembed` is the model's lm_head: every block's logit lens is
        decoded in one product (one per block would stream the unembedding matrix n_layer times)."""
        n_rows = len(self.rows)
        lens_inputs = self.model.ln_f(torch.stack(self._hidden_last)).flatten(0, 1)  # (n_layer * R, d)
        lens_probs, lens_ids = unembed(lens_inputs).float().softmax(dim=-1).topk(LOGIT_LENS_K, dim=-1)
        attention = [self._attention(r, length) for r, length in enumerate(self.lengths)]  # (n_layer, H, L, L) each
        heads = torch.stack([self._head_stats(r, length, attention[r]) for r, length in enumerate(self.lengths)], dim=1)
        maps = {r: self._maps(r, attention[r], unembed) for r, row in enumerate(self.rows) if row in self.mapped_rows}
        # One host copy each: (n_layer, R, 6, H), (n_layer, R, 3), (n_layer, R, k) twice.
        heads, norms = heads.tolist(), self._norms().tolist()
        lens_probs = lens_probs.view(-1, n_rows, LOGIT_LENS_K).tolist()
        lens_ids = lens_ids.view(-1, n_rows, LOGIT_LENS_K).tolist()

        marks = self.clock.times_ns(self._end_ns)  # start, embed end, each block's end, unembed end
        timeline = ForwardTimeline(
            embed=(marks[0], marks[1]), blocks=list(zip(marks[1:-2], marks[2:-1])), unembed=(marks[-2], marks[-1]),
        )
        config = self.model.config
        batch, padded = self.input_ids.shape
        d_model, n_head, d_head, d_mlp = config.d_model, config.n_head, config.d_head, config.d_mlp
        per_row = []
        for r, length in enumerate(self.lengths):
            layers = []
            for index, (start, end) in enumerate(timeline.blocks):
                entropy, max_weight, top_position, top_token_id, first, previous = heads[index][r]
                residual, attn_norm, mlp_norm = norms[index][r]
                layers.append(LayerReport(
                    index=index,
                    batch_hidden_shape=[batch, padded, d_model], batch_qkv_shape=[batch, n_head, padded, d_head],
                    batch_attn_shape=[batch, n_head, padded, padded], batch_mlp_shape=[batch, padded, d_mlp],
                    hidden_shape=[length, d_model], qkv_shape=[n_head, length, d_head],
                    attn_shape=[n_head, length, length], mlp_shape=[length, d_mlp],
                    heads=[
                        HeadSummary(entropy=e, max_weight=m, top_position=int(p), top_token_id=int(t),
                                    top_token=self.token_text(int(t)), first_token_weight=f, previous_token_score=v)
                        for e, m, p, t, f, v in zip(entropy, max_weight, top_position, top_token_id, first, previous)
                    ],
                    residual_norm=residual, attn_output_norm=attn_norm, mlp_output_norm=mlp_norm,
                    logit_lens=[TokenProb(int(i), self.token_text(int(i)), p)
                                for i, p in zip(lens_ids[index][r], lens_probs[index][r])],
                    duration_ms=(end - start) / 1e6,
                    **(maps[r][index] if r in maps else {}),
                ))
            per_row.append(layers)
        reported = dict(zip(self.rows, per_row))
        if self.twins:
            reported = self._beside_base(reported)
        return reported, timeline

    def _beside_base(self, reported: dict[int, list[LayerReport]]) -> dict[int, list[LayerReport]]:
        """Each row with a twin, its reports given how far the adapter moved each block from the
        base: ||adapter - base|| / ||base|| at the last position, of the residual stream after the
        block and of the block's attention and MLP outputs; and the base's logit lens beside its own."""
        index = {row: r for r, row in enumerate(self.rows)}
        own = torch.tensor([index[row] for row in self.twins], device=self.input_ids.device)  # (P,)
        twin = torch.tensor([index[t] for t in self.twins.values()], device=self.input_ids.device)  # (P,)
        shifts = []
        for captured in (self._hidden_last, self._attn_last, self._mlp_last):
            stacked = torch.stack(captured).float()  # (n_layer, R, d)
            base = stacked[:, twin]  # (n_layer, P, d)
            shifts.append((stacked[:, own] - base).norm(dim=-1) / base.norm(dim=-1).clamp_min(1e-12))  # (n_layer, P)
        shifts = torch.stack(shifts, dim=-1).tolist()  # (n_layer, P, 3): one host copy
        beside = {}
        for p, (row, twin_row) in enumerate(self.twins.items()):
            beside[row] = [replace(report, base_residual_shift=shifts[layer][p][0], base_attn_shift=shifts[layer][p][1],
                                   base_mlp_shift=shifts[layer][p][2], base_logit_lens=base.logit_lens)
                           for layer, (report, base) in enumerate(zip(reported[row], reported[twin_row]))]
        twin_rows = set(self.twins.values())
        return {row: beside.get(row, reports) for row, reports in reported.items() if row not in twin_rows}

    def finish(self) -> None:
        """Mark the end of the forward's last stage (after its outputs reached the host)."""
        self.clock.mark()
        self._end_ns = time.time_ns()
