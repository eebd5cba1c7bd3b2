"""Smaller weights for decoding on a CPU: `--quantize int8` or `--quantize fp16`.

Decoding one token reads every weight once, so on a CPU its speed follows the bytes read: fp32
GPT-2 small reads about 500 MB per token. Both modes swap every Linear (the LM head included)
and the token embedding for smaller ones, after loading; positions and layer norms stay fp32.

int8: weights per output channel (scale = the row's largest |w| / 127), multiplied int8 by int8
with int32 sums (exact): by engine.native's own kernel (AVX-512 VNNI / AVX2 / portable, weights in
its block layout) where that is built, else by fbgemm's GEMM (weights packed for it) with the
steps below as torch ops; both give the same integers. The kernels that take
fp32 activations with int8 weights (gpt-fast's `_weight_int8pack_mm`, torchao's CPU path) ran 2-25x
slower than fp32 on our AVX2 machine (`bench/engine/linear_kernels.py`), so the activations are
quantized too, but per row and in two parts, so that the answer is as close to fp32 as weight-only
int8 would be:
- each row is scaled to |x| <= 1 by its own largest value and rounded to 1/63 steps (7 bits: no
  int16 overflow in AVX2's u8 x s8 multiply-add); a fixed step, not the kernel's per-tensor one,
  so a row's result never depends on its batchmates;
- what that rounding lost (at most 1/126 of the row's largest value) is scaled up by the fixed
  126 (no second maximum to find: it is at most half a step) and rounded the same way, as a second
  row of the same GEMM: about 14 bits in all. Both parts reach the kernel as the integers they are
  (scale 1). One part alone gave 2% logit
  error on random weights (weight rounding alone gives 0.8%), and a row with an outlier feature
  would lose most of its other features to a 7-bit step.
llama.cpp's q8_0 also rounds activations for its int8 dot products, in blocks of 32.

fp16: weights stored fp16 and widened in registers (fbgemm's fp16 GEMM); fp32 activations and
accumulation. No CPU here computes in fp16; it halves the bytes read.

The token embedding shares the LM head's quantized rows when they are tied (as in every GPT-2):
the per-output-channel scale of the LM head is the per-token scale of the embedding.
CPU only: fbgemm has no CUDA kernels (on a GPU use --dtype float16/bfloat16).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import native
from .gpt2 import GPT2, Linear

MODES = ("none", "int8", "fp16")
ACTIVATION_STEPS = 63  # |x| <= 1 in steps of 1/63: quantized values 1..127 around the zero point 64
ZERO_POINT = 64


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) fp32 -> int8 (out, in) and fp32 scales (out,): w ~= int8 * scale."""
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales.float()


def _pack_int8(int8: torch.Tensor, scales: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are marked deprecated in torch 2.13, still there
        qweight = torch._make_per_channel_quantized_tensor(int8, scales.double(),
                                                           torch.zeros_like(scales, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """(N, in) -> (N, 1) each row's largest |x| (never 0: a zero row divides by a tiny number).
    abs().amax(), not vector_norm(inf): the same values, 6 µs against 38 µs at 16 rows of 768
    (2 cores, AVX-512), twice per Linear per step."""
    return x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)


def pack_blocks(int8: torch.Tensor) -> torch.Tensor:
    """(O, K) int8 -> engine.native's layout, flat: blocks of 16 output channels, in each the
    inputs by fours, 16 channels x 4 inputs per 64 bytes (one AVX-512 vector); zero padded."""
    O, K = int8.shape
    blocks, groups = -(-O // 16), -(-K // 4)
    padded = torch.zeros(blocks * 16, groups * 4, dtype=torch.int8)
    padded[:O, :K] = int8
    return padded.view(blocks, 16, groups, 4).transpose(1, 2).contiguous().view(-1)  # (blocks, groups, 16, 4)


class Int8Linear(nn.Module):
    def __init__(self, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = int8.shape[1], int8.shape[0]
        self.bias = bias
        self.native = native.available()
        if self.native:  # engine.native's int8_linear: its own kernel on its own layout, these steps in one op
            self.weight_blocks = pack_blocks(int8)
            self.scales = scales.float().contiguous()
            self.offsets = (ZERO_POINT * int8.sum(dim=1, dtype=torch.int32)).to(torch.int32)  # (out,)
        else:
            self.packed = _pack_int8(int8, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.gpt2serve.int8_linear(x, self.weight_blocks, self.scales, self.offsets, self.bias)
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in), fp32
        n = rows.shape[0]
        row_max = _row_max(rows)  # (N, 1)
        both = rows.new_empty(2 * n, self.in_features)  # (2N, in): the rounding error's rows, then the kept ones
        error, kept = both[:n], both[n:]
        torch.mul(rows, ACTIVATION_STEPS / row_max, out=error)  # |x| <= 63, in 1/63 units of the row's max
        torch.round(error, out=kept)  # what a 7-bit step keeps of it
        error.sub_(kept).mul_(2 * ACTIVATION_STEPS)  # the rounding error, |e| <= 1/2, scaled to |x| <= 63
        # Scale 1: the kernel takes each value as the integer it is (plus the zero point).
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            both, 1.0, ZERO_POINT, self.packed)  # (2N, out)
        # kept + error, each scaled back to the row's units: the error's rows were 126 times larger
        y = out[n:].add_(out[:n], alpha=1 / (2 * ACTIVATION_STEPS)).mul_(row_max / ACTIVATION_STEPS)  # (N, out)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Fp16Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # (N, in)
        y = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)  # (N, out)
        return y.reshape(*x.shape[:-1], self.out_features)


class RowScaledEmbedding(nn.Module):
    """An embedding table kept small (int8 rows with a scale each, or fp16), widened on lookup."""

    def __init__(self, table: torch.Tensor, scales: torch.Tensor | None):
        super().__init__()
        self.table, self.scales = table, scales  # (V, C) int8 or fp16; (V,) or None
        self.weight = None  # not an fp32 table any more (introspection asks for lm_head instead)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table[ids].float()  # (..., C)
        return rows if self.scales is None else rows * self.scales[ids][..., None]


def quantize(model: GPT2, mode: str) -> GPT2:
    """Swap the model's Linears and token embedding for `mode`'s, in place (fp32 CPU model)."""
    if mode == "none":
        return model
    if mode not in MODES:
        raise ValueError(f"--quantize {mode}: expected one of {', '.join(MODES)}")
    assert next(model.parameters()).device.type == "cpu", "quantized kernels are CPU only"
    with torch.inference_mode():
        wte = model.wte.weight.detach().float()
        if mode == "int8":
            table, scales = _int8_per_channel(wte)
            model.wte = RowScaledEmbedding(table, scales)
        else:
            model.wte = RowScaledEmbedding(wte.half(), None)
        tied = model.config.tie_lm_head
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, Linear):
                    continue
                weight, bias = child.weight.detach().float(), child.bias
                bias = None if bias is None else bias.detach().float()
                if mode == "int8":
                    int8, scales = (table, model.wte.scales) if tied and child is model.lm_head else _int8_per_channel(weight)
                    setattr(parent, name, Int8Linear(int8, scales, bias))
                else:
                    setattr(parent, name, Fp16Linear(weight, bias))
    model.tie_weights = lambda: None  # the embedding and head are rebuilt above, not shared Parameters
    return model
