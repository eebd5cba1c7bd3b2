"""GPT-2 in plain torch, for inference: the forward the engine runs, read top to bottom.

Dimensions: B batch, T padded length, C d_model, nh heads of hs = C / nh, V vocabulary.

Prompts are left-padded (see engine.padding): `valid` marks real tokens, and `position_ids`
count from 0 at each prompt's first real token. A query attends to the real keys at or before
it; a padding query attends to itself alone, so no row of the mask is empty (an empty row is a
NaN in some attention kernels) and nothing real ever looks at padding.

Introspection reads the forward through explicit taps (`ForwardTaps`): None on the fast path,
and the only place where anything outside the model sees its intermediate tensors.

Generation keeps keys and values between steps (`KeyValueStore`, see engine.kv_cache): a block
hands the store its new keys and values and attends over what the store gives back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2's initializer range


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_mlp: int = 3072
    n_ctx: int = 1024
    vocab_size: int = 50257
    layer_norm_eps: float = 1e-5
    gelu_approximate: str = "tanh"  # GPT-2's "gelu_new"; "none" for the exact GELU
    tie_lm_head: bool = True  # lm_head shares the token embedding (every GPT-2 checkpoint)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head


class ForwardTaps(Protocol):
    """What introspection sees of a forward (see introspection.probe)."""

    def embedded(self, x: torch.Tensor) -> None: ...  # (B, T, C): token + position embeddings

    def qkv(self, layer: int, qkv: torch.Tensor) -> None: ...  # (B, T, 3C), the fused projection

    def heads(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> None: ...
    # q (B, nh, T, hs); k, v (B, nh, S, hs) as attended over; y (B, nh, T, hs) the weighted values

    def mlp_hidden(self, layer: int, hidden: torch.Tensor) -> None: ...  # (B, T, d_mlp), after the GELU

    def block(self, layer: int, attn_out: torch.Tensor, mlp_out: torch.Tensor, hidden: torch.Tensor) -> None: ...
    # each (B, T, C): attention output, MLP output, residual stream after the block


class KeyValueStore(Protocol):
    """Where a forward keeps its keys and values for later steps (see engine.kv_cache)."""

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    # k, v (B, nh, T, hs) of this forward's tokens -> the keys and values to attend over (B, nh, S, hs)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None: ...
    # A store that attends by itself (engine.native's decode attention): keeps k, v and returns
    # y (B, nh, T, hs), reading only the keys each query sees; None: `attend`, then the kernel below


class Adapters(Protocol):
    """LoRA adapters chosen per token of a forward (engine.lora.AdapterRows)."""

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    # x (..., in) a projection's input, y (..., out) its output -> y plus its adapter terms


class ShapesOnMeta:
    """Modules built on the meta device (shapes only, as every loader here builds them) skip their
    random init: torch runs normal_ and fill_ (and empty_like) on meta through its decompositions,
    whose import (sympy and more) a server would carry for life, about 70 MB."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Embedding(ShapesOnMeta, nn.Embedding):
    pass


class LayerNorm(ShapesOnMeta, nn.LayerNorm):
    pass


class Linear(ShapesOnMeta, nn.Linear):
    """nn.Linear, computed on a CPU as W @ x.T (transposed back, a view): the same dot products,
    but MKL's GEMM in that orientation has no cliff at a few rows, where a decode step's rows
    are; from tens of rows up the two cost the same (docs/benchmarks-history.md, "CPU kernels
    for a decode step")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.bias is None:
            y = self.weight @ rows.T  # (out, N)
        else:
            y = torch.addmm(self.bias[:, None], self.weight, rows.T)  # (out, N): bias added in the GEMM
        return y.T.reshape(*x.shape[:-1], self.out_features)  # (..., out)


def attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True = real token -> (B, 1, T, T) bool, True = may attend."""
    T = valid.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()  # (T, T)
    diagonal = torch.eye(T, dtype=torch.bool, device=valid.device)  # (T, T): padding sees itself
    return (causal & (valid[:, None, :] | diagonal))[:, None]  # (B, 1, T, T)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = Linear(config.d_model, 3 * config.d_model)  # fused Q, K, V projection
        self.proj = Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, taps: ForwardTaps | None, layer: int,
                kv: KeyValueStore | None = None, adapters: Adapters | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x)  # (B, T, 3C)
        if adapters is not None:
            qkv = adapters.add(layer, "attn.qkv", x, qkv)
        if taps is not None:
            taps.qkv(layer, qkv)
        q, k, v = qkv.split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = kv.attention(layer, q, k, v) if kv is not None else None  # (B, nh, T, hs)
        if y is None:
            if kv is not None:
                k, v = kv.attend(layer, k, v)  # (B, nh, S, hs): with the keys of earlier steps; mask (B, 1, T, S)
            # Fused kernel; written out it is softmax((q @ k^T) / sqrt(hs), masked) @ v. Without
            # a mask, each query sees the keys up to its own column, and the kernel skips the rest
            # (half the work of a long prompt; a mask makes it compute every pair, then hide half).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # (B, nh, T, hs)
        if taps is not None:
            taps.heads(layer, q, k, v, y)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        out = self.proj(y)  # (B, T, C)
        return out if adapters is None else adapters.add(layer, "attn.proj", y, out)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.fc = Linear(config.d_model, config.d_mlp)
        self.proj = Linear(config.d_mlp, config.d_model)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor, taps: ForwardTaps | None = None, layer: int = 0,
                adapters: Adapters | None = None) -> torch.Tensor:
        fc = self.fc(x)  # (B, T, d_mlp)
        if adapters is not None:
            fc = adapters.add(layer, "mlp.fc", x, fc)
        hidden = F.gelu(fc, approximate=self.approximate)  # (B, T, d_mlp)
        if taps is not None:
            taps.mlp_hidden(layer, hidden)
        out = self.proj(hidden)  # (B, T, C)
        return out if adapters is None else adapters.add(layer, "mlp.proj", hidden, out)


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, taps: ForwardTaps | None, layer: int,
                kv: KeyValueStore | None = None, adapters: Adapters | None = None) -> torch.Tensor:
        attn_out = self.attn(self.ln_1(x), mask, taps, layer, kv, adapters)  # (B, T, C)
        x = x + attn_out
        mlp_out = self.mlp(self.ln_2(x), taps, layer, adapters)  # (B, T, C)
        x = x + mlp_out
        if taps is not None:
            taps.block(layer, attn_out, mlp_out, x)
        return x


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.d_model)
        self.wpe = Embedding(config.n_ctx, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_lm_head:
            self.lm_head.weight = self.wte.weight

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor | None,
                      taps: ForwardTaps | None = None, kv: KeyValueStore | None = None,
                      mask: torch.Tensor | None = None, adapters: Adapters | None = None) -> torch.Tensor:
        """(B, T) token ids, positions and real-token mask -> (B, T, C) residual stream after the
        last block (before ln_f). With `kv`, `mask` (B, 1, T, S) says which of the store's keys
        each query sees; without, the mask follows from `valid`. With neither, each query sees the
        keys up to its own column (right-padded rows: a real token never sees the padding).
        `adapters`: which tokens take which LoRA adapter (engine.lora.AdapterRows); None: the base alone."""
        if mask is None and valid is not None:
            mask = attention_mask(valid)  # (B, 1, T, T), shared by every block
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        if taps is not None:
            taps.embedded(x)
        for layer, block in enumerate(self.blocks):
            x = block(x, mask, taps, layer, kv, adapters)  # (B, T, C)
        return x

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits for the next token after each row's last position: (B, V). Only that position
        goes through ln_f and lm_head; a server never needs the others."""
        x = self.hidden_states(input_ids, position_ids, valid)  # (B, T, C)
        return self.head(x[:, -1, :])  # (B, V)

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        """(..., C) residual-stream rows -> (..., V) logits: ln_f, then lm_head (on a CPU with no
        cliff at a few rows, see Linear, which a decode step's rows would fall into)."""
        return self.lm_head(self.ln_f(rows))

    @classmethod
    def random(cls, config: GPT2Config, seed: int) -> GPT2:
        """Seeded random weights in fp32 on the CPU (GPT-2's scheme: N(0, 0.02), residual
        projections scaled by 1/sqrt(2 * n_layer)), without disturbing the global RNG."""
        with torch.device("meta"):
            model = cls(config)
        for module in model.modules():  # real (uninitialized) CPU tensors; not to_empty(), see ShapesOnMeta
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty(param.shape), requires_grad=False))
        model.tie_weights()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif ".ln_" in name or name.startswith("ln_f"):
                    param.fill_(1.0)
                else:
                    std = INIT_STD / math.sqrt(2 * config.n_layer) if name.endswith("proj.weight") else INIT_STD
                    param.normal_(0.0, std, generator=generator)
        return model.eval().requires_grad_(False)
