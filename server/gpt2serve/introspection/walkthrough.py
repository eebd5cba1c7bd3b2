"""The shape walk-through: every matrix a forward multiplies, data and weights, in the order the
seeds' explainers draw them (token ids -> embeddings -> each block -> the last row -> logits).

Two sources, one list of `ShapeStep`s:
- `traced_walkthrough`: what a real forward produced. `ShapeRecorder` is the forward's taps
  (engine.gpt2.ForwardTaps); it keeps the shape of each tensor the first block computed (every
  block has the same shapes), and the weights' shapes are read off the model's own modules.
  Only shapes are kept (host metadata), so recording costs nothing on the device; it runs on the
  meta device too, which is how a test draws gpt2-xl without its weights.
- `preset_walkthrough`: an Architecture's shapes, analytic (Llama, Qwen, DeepSeek: models this
  server does not run), for `gpt2serve params --shapes` and /ui's preset view.

Weights are written [in, out], as in x @ W (the explainers' orientation); torch stores a
Linear's weight as [out, in].
"""

from __future__ import annotations

from typing import Any, Sequence

from gpt2serve_client.types import ShapeStep

from .architectures import Architecture


def data_step(stage: str, name: str, shape: Sequence[int], note: str = "") -> ShapeStep:
    return ShapeStep(stage=stage, name=name, kind="data", shape=[int(n) for n in shape], note=note)


def weight_step(stage: str, name: str, shape: Sequence[int], note: str = "") -> ShapeStep:
    return ShapeStep(stage=stage, name=name, kind="weight", shape=[int(n) for n in shape], note=note)


_LAYER_NORM = "LayerNorm: a gain and a shift per channel"
_LOGITS, _CHOSEN = "one score per vocabulary entry", "the best logit, or a sample from them"


class ShapeRecorder:
    """ForwardTaps that keep shapes: of the first block's tensors, and of the input and output."""

    def __init__(self) -> None:
        self.shapes: dict[str, list[int]] = {}
        self.n_layer = 0

    def _keep(self, name: str, tensor: Any) -> None:
        self.shapes[name] = list(tensor.shape)

    def embedded(self, x: Any) -> None:  # (B, T, C)
        self._keep("embedded", x)

    def qkv(self, layer: int, qkv: Any) -> None:  # (B, T, 3C)
        if layer == 0:
            self._keep("qkv", qkv)

    def heads(self, layer: int, q: Any, k: Any, v: Any, y: Any) -> None:  # (B, nh, T|S, hs) each
        if layer == 0:
            for name, tensor in (("q", q), ("k", k), ("v", v), ("weighted_v", y)):
                self._keep(name, tensor)
            self.shapes["scores"] = [*q.shape[:-1], k.shape[-2]]  # (B, nh, T, S): what SDPA computes inside

    def mlp_hidden(self, layer: int, hidden: Any) -> None:  # (B, T, d_mlp)
        if layer == 0:
            self._keep("mlp_hidden", hidden)

    def block(self, layer: int, attn_out: Any, mlp_out: Any, hidden: Any) -> None:  # (B, T, C) each
        self.n_layer = layer + 1
        if layer == 0:
            self._keep("attn_out", attn_out)
            self._keep("mlp_out", mlp_out)
            self._keep("block_out", hidden)

    def unembedded(self, last: Any, logits: Any) -> None:  # (B, C), (B, V)
        self._keep("last", last)
        self._keep("logits", logits)


def _in_out(module: Any) -> list[int]:
    """A Linear's (or a quantized one's) matrix as [in, out]."""
    return [module.in_features, module.out_features]


def traced_walkthrough(recorder: ShapeRecorder, model: Any) -> list[ShapeStep]:
    """What a real forward computed (shapes from `recorder`) with the model's weights (engine.gpt2.GPT2)."""
    s, block, config = recorder.shapes, model.blocks[0], model.config
    B, T = s["embedded"][:2]  # the token ids' shape
    wte = list((model.wte.table if model.wte.weight is None else model.wte.weight).shape)  # quantized: its table
    merged = [s["weighted_v"][0], s["weighted_v"][2], s["weighted_v"][1] * s["weighted_v"][3]]
    tied = "tied: the token embedding, transposed" if config.tie_lm_head else "untied"
    steps = [
        data_step("input", "token ids", [B, T], "each prompt a row, padded to the batch's longest"),
        weight_step("input", "token embedding", wte, "wte: one row per vocabulary entry"),
        weight_step("input", "position embedding", list(model.wpe.weight.shape), "wpe: one row per position"),
        data_step("input", "token + position embeddings", s["embedded"]),
        weight_step("block", "attention norm", list(block.ln_1.weight.shape), "ln_1, " + _LAYER_NORM),
        data_step("block", "normalised", s["embedded"]),
        weight_step("block", "W_QKV", _in_out(block.attn.qkv), "Q, K and V projections side by side, with biases"),
        data_step("block", "Q, K, V", s["qkv"]),
        data_step("block", "Q per head", s["q"], "d_model split into heads"),
        data_step("block", "K per head", s["k"]),
        data_step("block", "V per head", s["v"]),
        data_step("block", "QKᵀ / √d_head, masked", s["scores"], "a query sees its own and earlier keys"),
        data_step("block", "softmax: attention weights", s["scores"], "each row sums to 1"),
        data_step("block", "weights × V", s["weighted_v"]),
        data_step("block", "heads merged", merged),
        weight_step("block", "W_O (projection)", _in_out(block.attn.proj)),
        data_step("block", "attention output", s["attn_out"]),
        data_step("block", "residual + attention", s["attn_out"]),
        weight_step("block", "MLP norm", list(block.ln_2.weight.shape), "ln_2, " + _LAYER_NORM),
        data_step("block", "normalised", s["attn_out"]),
        weight_step("block", "W_up (fc)", _in_out(block.mlp.fc), "the MLP's expansion"),
        data_step("block", "MLP hidden, GELU", s["mlp_hidden"]),
        weight_step("block", "W_down (proj)", _in_out(block.mlp.proj), "the MLP's contraction"),
        data_step("block", "MLP output", s["mlp_out"]),
        data_step("block", "residual + MLP", s["block_out"], f"the block's output; {recorder.n_layer} blocks in all"),
        data_step("output", "last row", s["last"], "only the last position predicts the next token"),
        weight_step("output", "final norm", list(model.ln_f.weight.shape), "ln_f, " + _LAYER_NORM),
        data_step("output", "normalised last row", s["last"]),
        weight_step("output", "lm_head", _in_out(model.lm_head), tied),
        data_step("output", "logits", s["logits"], _LOGITS),
        data_step("output", "chosen token", s["logits"][:1], _CHOSEN),
    ]
    return steps


def _attention_steps(arch: Architecture, B: int, T: int) -> list[ShapeStep]:
    d, H, dh, KV = arch.d_model, arch.n_head, arch.d_head, arch.kv_heads
    if arch.mla:
        m = arch.mla
        dqk = m.d_nope + m.d_rope
        query = ([weight_step("block", "W_DQ (query down)", [d, m.q_rank]), data_step("block", "query latent", [B, T, m.q_rank]),
                  weight_step("block", "q latent norm", [m.q_rank], "RMSNorm"),
                  weight_step("block", "W_UQ (query up)", [m.q_rank, H * dqk])] if m.q_rank
                 else [weight_step("block", "W_Q", [d, H * dqk])])
        return [*query,
                weight_step("block", "W_DKV (key/value down)", [d, m.kv_rank + m.d_rope],
                        "to one latent per token and a rotary key shared by every head"),
                data_step("block", "kv latent (what the cache keeps)", [B, T, m.kv_rank + m.d_rope],
                      f"{m.kv_rank + m.d_rope} numbers a token instead of {2 * H * dqk}"),
                weight_step("block", "kv latent norm", [m.kv_rank], "RMSNorm"),
                weight_step("block", "W_UKV (key/value up)", [m.kv_rank, H * (m.d_nope + m.d_value)]),
                data_step("block", "Q per head", [B, H, T, dqk], f"{m.d_nope} without position + {m.d_rope} rotary"),
                data_step("block", "K per head", [B, H, T, dqk]),
                data_step("block", "V per head", [B, H, T, m.d_value]),
                data_step("block", "QKᵀ / √d_head, masked", [B, H, T, T]),
                data_step("block", "softmax: attention weights", [B, H, T, T]),
                data_step("block", "weights × V", [B, H, T, m.d_value]),
                data_step("block", "heads merged", [B, T, H * m.d_value]),
                weight_step("block", "W_O (projection)", [H * m.d_value, d])]
    if KV == H and arch.family in ("gpt2", "openai-gpt"):
        projections = [weight_step("block", "W_QKV", [d, 3 * d], "Q, K and V projections side by side, with biases"),
                       data_step("block", "Q, K, V", [B, T, 3 * d])]
    else:
        note = f"grouped-query: {KV} key/value heads, each shared by {H // KV} query heads" if KV != H else ""
        projections = [weight_step("block", "W_Q", [d, H * dh]), weight_step("block", "W_K", [d, KV * dh], note),
                       weight_step("block", "W_V", [d, KV * dh], note),
                       data_step("block", "Q", [B, T, H * dh]), data_step("block", "K, V", [B, T, 2 * KV * dh], note)]
    rope = "; rotated by position (RoPE)" if arch.positions == "rope" else ""
    return [*projections,
            data_step("block", "Q per head", [B, H, T, dh], "d_model split into heads" + rope),
            data_step("block", "K per head", [B, KV, T, dh], rope.lstrip("; ")),
            data_step("block", "V per head", [B, KV, T, dh]),
            data_step("block", "QKᵀ / √d_head, masked", [B, H, T, T], "a query sees its own and earlier keys"),
            data_step("block", "softmax: attention weights", [B, H, T, T], "each row sums to 1"),
            data_step("block", "weights × V", [B, H, T, dh]),
            data_step("block", "heads merged", [B, T, H * dh]),
            weight_step("block", "W_O (projection)", [H * dh, d])]


def _mlp_steps(arch: Architecture, B: int, T: int) -> list[ShapeStep]:
    d, m = arch.d_model, arch.d_mlp
    if arch.moe:
        e = arch.moe
        return [weight_step("block", "router", [d, e.n_routed], "scores every routed expert"),
                data_step("block", "router scores", [B, T, e.n_routed]),
                data_step("block", "chosen experts", [B, T, e.top_k], f"top {e.top_k} of {e.n_routed}"),
                weight_step("block", "routed experts: W_gate, W_up, W_down", [e.n_routed, 3, d, e.d_expert],
                        f"{e.top_k} of them run for each token"),
                data_step("block", "routed experts' hidden, SiLU(gate) × up", [B, T, e.top_k, e.d_expert]),
                weight_step("block", "shared experts: W_gate, W_up, W_down", [e.n_shared, 3, d, e.d_expert],
                        "every token goes through them"),
                data_step("block", "shared experts' hidden", [B, T, e.n_shared * e.d_expert]),
                data_step("block", "MoE output (weighted sum)", [B, T, d])]
    if arch.mlp == "swiglu":
        return [weight_step("block", "W_gate", [d, m]), weight_step("block", "W_up", [d, m], "the MLP's expansion"),
                data_step("block", "MLP hidden, SiLU(gate) × up", [B, T, m], "SwiGLU"),
                weight_step("block", "W_down", [m, d], "the MLP's contraction"), data_step("block", "MLP output", [B, T, d])]
    return [weight_step("block", "W_up (fc)", [d, m], "the MLP's expansion"), data_step("block", "MLP hidden, GELU", [B, T, m]),
            weight_step("block", "W_down (proj)", [m, d], "the MLP's contraction"), data_step("block", "MLP output", [B, T, d])]


def preset_walkthrough(arch: Architecture, batch: int = 1, tokens: int = 5) -> list[ShapeStep]:
    """An Architecture's forward for `batch` prompts of `tokens` tokens, without weights. A MoE
    model's block is drawn as one of its MoE blocks."""
    B, T, d, V = batch, tokens, arch.d_model, arch.vocab_size
    norm = "RMSNorm: a gain per channel" if arch.norm == "rmsnorm" else _LAYER_NORM
    inputs = [data_step("input", "token ids", [B, T]), weight_step("input", "token embedding", [V, d], "one row per vocabulary entry")]
    if arch.positions == "learned":
        inputs += [weight_step("input", "position embedding", [arch.n_ctx, d], "one row per position"),
                   data_step("input", "token + position embeddings", [B, T, d])]
    else:
        inputs.append(data_step("input", "token embeddings", [B, T, d], "positions enter as rotations of Q and K (RoPE)"))
    block = [weight_step("block", "attention norm", [d], norm), data_step("block", "normalised", [B, T, d]),
             *_attention_steps(arch, B, T), data_step("block", "attention output", [B, T, d]),
             data_step("block", "residual + attention", [B, T, d]),
             weight_step("block", "MLP norm", [d], norm), data_step("block", "normalised", [B, T, d]), *_mlp_steps(arch, B, T),
             data_step("block", "residual + MLP", [B, T, d], f"the block's output; {arch.n_layer} blocks in all")]
    head = "tied: the token embedding, transposed" if arch.tied_lm_head else "untied"
    outputs = [data_step("output", "last row", [B, d], "only the last position predicts the next token")]
    if arch.final_norm:
        outputs += [weight_step("output", "final norm", [d], norm), data_step("output", "normalised last row", [B, d])]
    outputs += [weight_step("output", "lm_head", [d, V], head), data_step("output", "logits", [B, V], _LOGITS),
                data_step("output", "chosen token", [B], _CHOSEN)]
    return inputs + block + outputs


def format_shapes(name: str, steps: Sequence[ShapeStep]) -> str:
    lines = [f"{name}: the forward's shapes (data and weights [in, out], as in x @ W)"]
    stage = ""
    for step in steps:
        if step.stage != stage:
            stage = step.stage
            lines.append({"input": "\ninput", "block": "\neach block", "output": "\noutput"}[stage])
        shape = "[" + ", ".join(str(n) for n in step.shape) + "]"
        lines.append(f"  {step.kind:<6} {step.name:<40} {shape:<24} {step.note}".rstrip())
    return "\n".join(lines)
