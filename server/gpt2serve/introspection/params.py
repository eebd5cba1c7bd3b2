"""Where a model's parameters live, counted analytically from its Architecture.

`gpt2serve params` prints it for a preset, any HF config.json or any GPT-2 shape; model_info
counts the real tensors of a loaded model into the same fields, and tests check the count
against those tensors (served sizes), against transformers' own modules built on the meta
device (every preset) and against each model card's published figure.
No torch here: the command starts at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .architectures import (PRESETS, SERVABLE, Architecture, ConfigError, as_dict, from_hf_config,
                            published_summary)

__all__ = ["PRESETS", "SERVABLE", "Breakdown", "count", "add_params_arguments", "run_params"]


@dataclass(frozen=True)
class Line:
    key: str  # stable name, e.g. "attention_qkv"; ModelInfo's ParameterBreakdown uses the GPT-2 ones
    component: str
    parameters: int
    note: str = ""


@dataclass(frozen=True)
class Breakdown:
    arch: Architecture
    lines: tuple[Line, ...]
    total: int
    active: int | None  # a mixture of experts: what one token goes through
    block: int  # one block (the last one, a MoE block where there are any)

    def __getitem__(self, key: str) -> int:
        return sum(line.parameters for line in self.lines if line.key == key)

    @property
    def non_embedding(self) -> int:
        return self.total - self["token_embedding"] - self["position_embedding"] - self["lm_head"]


def _norm(arch: Architecture, width: int) -> int:
    return width if arch.norm == "rmsnorm" else 2 * width  # RMSNorm: a gain; LayerNorm: gain and shift


def _mlp(arch: Architecture, hidden: int) -> int:
    d = arch.d_model
    if arch.mlp == "swiglu":
        return 3 * d * hidden + (2 * hidden + d if arch.biases == "all" else 0)  # gate, up, down
    return 2 * d * hidden + (hidden + d if arch.biases == "all" else 0)  # up, down


def _attention(arch: Architecture) -> dict[str, int]:
    """One block's attention parameters by line key."""
    d, h = arch.d_model, arch.n_head
    if arch.mla:
        m = arch.mla
        d_qk = m.d_nope + m.d_rope
        down = (d * m.q_rank if m.q_rank else 0) + d * (m.kv_rank + m.d_rope)  # to the latents (+ shared rope key)
        up = (m.q_rank if m.q_rank else d) * h * d_qk + m.kv_rank * h * (m.d_nope + m.d_value)
        return {"mla_down": down, "mla_up": up, "attention_output": h * m.d_value * d,
                "norms": m.kv_rank + (m.q_rank and _norm(arch, m.q_rank))}
    q, kv = d * h * arch.d_head, 2 * d * arch.kv_heads * arch.d_head
    if arch.biases != "none":
        q, kv = q + h * arch.d_head, kv + 2 * arch.kv_heads * arch.d_head
    output = d * d + (d if arch.biases == "all" else 0)
    if arch.kv_heads == arch.n_head:
        return {"attention_qkv": q + kv, "attention_output": output}
    return {"attention_q": q, "attention_kv": kv, "attention_output": output}


def _block(arch: Architecture, layer: int) -> dict[str, int]:
    counts = dict(_attention(arch))
    counts["norms"] = counts.get("norms", 0) + 2 * _norm(arch, arch.d_model)
    if arch.is_moe_layer(layer):
        e = arch.moe
        counts.update(moe_router=e.n_routed * arch.d_model, moe_shared=e.n_shared * _mlp(arch, e.d_expert),
                      moe_routed=e.n_routed * _mlp(arch, e.d_expert))
    else:
        counts["mlp"] = _mlp(arch, arch.d_mlp)
    return counts


def _labels(arch: Architecture) -> dict[str, tuple[str, str]]:
    """Line key -> (component, note): the note names the architecture feature behind the line."""
    n, d = arch.n_layer, arch.d_model
    moe, mla = arch.moe, arch.mla
    dense = f"{moe.first_dense} dense blocks" if moe else f"{n} blocks"
    mlp = "SwiGLU: gate, up and down matrices" if arch.mlp == "swiglu" else "GELU: up and down, with biases"
    return {
        "token_embedding": ("token embedding", f"{arch.vocab_size} x {d}"),
        "position_embedding": ("position embedding", f"learned, {arch.n_ctx} x {d}" if arch.positions == "learned"
                               else "rotary (RoPE): rotations, no parameters"),
        "attention_qkv": (f"attention Q, K, V ({n} blocks)", f"{arch.n_head} heads of {arch.d_head}"
                          + (", biases" if arch.biases != "none" else "")),
        "attention_q": (f"attention Q ({n} blocks)", f"{arch.n_head} query heads of {arch.d_head}"
                        + (", biases" if arch.biases != "none" else "")),
        "attention_kv": (f"attention K, V ({n} blocks)", f"grouped-query attention: {arch.kv_heads} key/value heads, "
                         f"each shared by {arch.n_head // arch.kv_heads} query heads"),
        "mla_down": (f"latent attention, down ({n} blocks)", mla and (
            f"multi-head latent attention: x -> {'q latent ' + str(mla.q_rank) + ', ' if mla.q_rank else ''}"
            f"kv latent {mla.kv_rank} + shared rotary key {mla.d_rope}")),
        "mla_up": (f"latent attention, up ({n} blocks)", mla and (
            f"latents -> {arch.n_head} heads: q/k {mla.d_nope}+{mla.d_rope}, v {mla.d_value}")),
        "attention_output": (f"attention output ({n} blocks)", ""),
        "mlp": (f"MLP ({dense})", f"{mlp}, {arch.d_mlp} wide"),
        "moe_router": (f"MoE router ({moe and n - moe.first_dense} blocks)", moe and f"{moe.n_routed} expert scores"),
        "moe_shared": ("MoE shared experts", moe and f"{moe.n_shared} a block, every token; {mlp}, {moe.d_expert} wide"),
        "moe_routed": ("MoE routed experts", moe and f"{moe.n_routed} a block, {moe.top_k} active per token"),
        "norms": ("norms", ("RMSNorm: a gain" if arch.norm == "rmsnorm" else "LayerNorm: gain and shift")
                  + (", two a block" + (" and the final one" if arch.final_norm else ", no final norm"))
                  + (" and the two latent norms" if mla else "")),
        "lm_head": ("lm_head", "untied: its own vocabulary x d_model matrix" if not arch.tied_lm_head
                    else "tied: shares the token embedding"),
    }


def count(arch: Architecture) -> Breakdown:
    totals: dict[str, int] = {"token_embedding": arch.vocab_size * arch.d_model,
                              "position_embedding": arch.n_ctx * arch.d_model if arch.positions == "learned" else 0}
    for layer in range(arch.n_layer):
        for key, value in _block(arch, layer).items():
            totals[key] = totals.get(key, 0) + value
    totals["norms"] += _norm(arch, arch.d_model) if arch.final_norm else 0
    totals["lm_head"] = 0 if arch.tied_lm_head else arch.vocab_size * arch.d_model
    labels = _labels(arch)
    order = [key for key in labels if key in totals]
    lines = tuple(Line(key, labels[key][0], totals[key], labels[key][1] or "") for key in order)
    total = sum(totals.values())
    active = None
    if arch.moe:  # what one token multiplies: not the idle routed experts, nor the embedding table (one row read)
        idle = arch.moe.n_routed - arch.moe.top_k
        active = total - totals["token_embedding"] - sum(idle * _mlp(arch, arch.moe.d_expert)
                                                         for layer in range(arch.n_layer) if arch.is_moe_layer(layer))
    return Breakdown(arch, lines, total, active, sum(_block(arch, arch.n_layer - 1).values()))


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def format_table(name: str, b: Breakdown) -> str:
    def row(label: str, value: int, note: str = "") -> str:
        return f"{label:<36} {value:>17,} {100 * value / b.total:>8.2f}%  {note}".rstrip()

    lines = [f"{name}: {b.arch.describe()}", "", f"{'component':<36} {'parameters':>17} {'share':>9}"]
    lines += [row(line.component, line.parameters, line.note) for line in b.lines]
    lines.append(row("total", b.total))
    if b.active is not None:
        lines.append(row("active per token", b.active, f"the shared experts and {b.arch.moe.top_k} routed a block; "
                                                      "not the embedding table (a token reads one row)"))
    lines += ["", row("one block" + (" (MoE)" if b.arch.moe else ""), b.block),
              f"total: {b.total:,} parameters ({_human(b.total)})"
              + (f", active {b.active:,} ({_human(b.active)})" if b.active is not None else "")]
    if b.arch.published:
        lines.append(f"published: {published_summary(b.arch)}")
    return "\n".join(lines)


def as_json(name: str, b: Breakdown) -> str:
    body = {"name": name, "architecture": as_dict(b.arch),
            "lines": [{"key": line.key, "component": line.component, "parameters": line.parameters,
                       "note": line.note} for line in b.lines],
            "total": b.total, "non_embedding": b.non_embedding}
    if b.active is not None:
        body["active"] = b.active
    if b.arch.published:
        body["published"] = {"total": b.arch.published, "active": b.arch.published_active or None,
                             "non_embedding": b.arch.published_non_embedding or None, "source": b.arch.source,
                             "note": b.arch.card_note or None}
    return json.dumps(body, indent=2)


_OVERRIDES = (("--n-layer", "n_layer"), ("--d-model", "d_model"), ("--n-head", "n_head"), ("--d-mlp", "d_mlp"),
              ("--vocab", "vocab_size"), ("--n-ctx", "n_ctx"))


def add_params_arguments(parser) -> None:
    parser.add_argument("preset", nargs="?", choices=sorted(PRESETS), default="gpt2", metavar="PRESET",
                        help=f"a known model (default gpt2): {', '.join(PRESETS)}; the flags below override it")
    parser.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder) to count "
                        "instead: gpt2, openai-gpt, llama, qwen2, deepseek_v2 or deepseek_v3")
    for flag, key in _OVERRIDES:
        parser.add_argument(flag, dest=key, type=int, help=f"override {key}")
    parser.add_argument("--untied", action="store_true", help="lm_head has its own weights")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON (integer total, and "
                        "active for a mixture of experts)")
    parser.add_argument("--shapes", action="store_true", help="print the forward's shapes instead, block by "
                        "block, for --tokens tokens")
    parser.add_argument("--tokens", type=int, default=5, help="sequence length for --shapes (default 5)")
    parser.add_argument("--batch", type=int, default=1, help="batch size for --shapes (default 1)")


def _architecture(args) -> tuple[str, Architecture]:
    if args.config:
        path = Path(args.config)
        path = path / "config.json" if path.is_dir() else path
        try:
            return str(path), from_hf_config(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read {path}: {error}") from None
    arch = PRESETS[args.preset]
    overrides = {key: getattr(args, key) for _, key in _OVERRIDES if getattr(args, key, None) is not None}
    if "d_model" in overrides and args.d_mlp is None and arch.family == "gpt2":
        overrides["d_mlp"] = 4 * overrides["d_model"]
    if args.untied:
        overrides["tied_lm_head"] = False
    if not overrides:
        return args.preset, arch
    arch = replace(arch, published="", source="", **overrides)
    return f"{args.preset} with {', '.join(f'{k}={v}' for k, v in overrides.items())}", arch


def _check(arch: Architecture) -> str:
    sizes = {key: getattr(arch, key) for key in ("n_layer", "d_model", "n_head", "d_mlp", "vocab_size")}
    bad = [key for key, value in sizes.items() if value < 1]
    if bad:
        return f"{', '.join(bad)} must be positive"
    if not arch.mla and arch.d_model % arch.n_head:
        return "d_model must be a multiple of n_head"
    if arch.n_head % arch.kv_heads:
        return "n_head must be a multiple of the key/value heads"
    return ""


def run_params(args) -> int:
    from .walkthrough import format_shapes, preset_walkthrough  # only --shapes needs it

    try:
        name, arch = _architecture(args)
    except ConfigError as error:
        print(f"gpt2serve params: {error}")
        return 2
    problem = _check(arch)
    if problem:
        print(f"gpt2serve params: {problem}")
        return 2
    if args.shapes:
        steps = preset_walkthrough(arch, batch=max(args.batch, 1), tokens=max(args.tokens, 1))
        print(json.dumps([asdict(step) for step in steps], indent=1) if args.json else format_shapes(name, steps))
        return 0
    breakdown = count(arch)
    print(as_json(name, breakdown) if args.json else format_table(name, breakdown))
    return 0
