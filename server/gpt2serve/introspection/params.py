"""Where a GPT-2-shaped model's parameters live, counted analytically from its dimensions.

`gpt2serve params` prints it for a preset or any shape; model_info counts the real tensors of a
loaded model into the same fields, and a test checks the two agree for every `random:` size.
No torch here: the command starts at once.
"""

from __future__ import annotations

from dataclasses import dataclass

# The GPT-2 family (all share GPT-2's 50257-token vocabulary), and GPT-3 175B for scale.
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, d_mlp=3072, n_ctx=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, d_mlp=4096, n_ctx=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, d_mlp=5120, n_ctx=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_head=25, d_model=1600, d_mlp=6400, n_ctx=1024, vocab_size=50257),
    "distilgpt2": dict(n_layer=6, n_head=12, d_model=768, d_mlp=3072, n_ctx=1024, vocab_size=50257),
    "tiny": dict(n_layer=2, n_head=4, d_model=64, d_mlp=256, n_ctx=256, vocab_size=50257),
    "gpt3-175b": dict(n_layer=96, n_head=96, d_model=12288, d_mlp=4 * 12288, n_ctx=2048, vocab_size=50257),
}
SERVABLE = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2", "tiny")  # random:<name>


@dataclass(frozen=True)
class ParameterCount:
    """Fields as in the served ModelInfo's ParameterBreakdown, plus the per-block split."""

    token_embedding: int
    position_embedding: int
    attention_qkv: int  # all blocks
    attention_output: int
    mlp: int
    layer_norm: int  # two per block, and ln_f
    lm_head: int  # 0 when tied to the token embedding
    total: int
    n_layer: int
    block_attention: int  # one block's QKV and output projections
    block_mlp: int
    block_layer_norm: int

    @property
    def block(self) -> int:
        return self.block_attention + self.block_mlp + self.block_layer_norm


def count_parameters(n_layer: int, d_model: int, d_mlp: int, n_ctx: int, vocab_size: int,
                     tied_lm_head: bool = True, **_) -> ParameterCount:
    d, m = d_model, d_mlp
    qkv, attn_out = d * 3 * d + 3 * d, d * d + d  # weights + biases
    mlp = d * m + m + m * d + d  # up and down projections
    norms = 2 * (d + d)  # ln_1 and ln_2: scale and shift
    embedding, position, lm_head = vocab_size * d, n_ctx * d, 0 if tied_lm_head else vocab_size * d
    per_layer = dict(attention_qkv=n_layer * qkv, attention_output=n_layer * attn_out, mlp=n_layer * mlp,
                     layer_norm=n_layer * norms + 2 * d)  # + ln_f
    total = embedding + position + sum(per_layer.values()) + lm_head
    return ParameterCount(token_embedding=embedding, position_embedding=position, lm_head=lm_head, total=total,
                          n_layer=n_layer, block_attention=qkv + attn_out, block_mlp=mlp, block_layer_norm=norms,
                          **per_layer)


def format_table(name: str, shape: dict[str, int], count: ParameterCount, tied: bool) -> str:
    total = count.total

    def row(label: str, value: int, note: str = "") -> str:
        return f"{label:<30} {value:>17,} {100 * value / total:>8.2f}%  {note}".rstrip()

    n = count.n_layer
    lines = [
        f"{name}: {shape['n_layer']} layers, d_model {shape['d_model']}, {shape['n_head']} heads of "
        f"{shape['d_model'] // shape['n_head']}, d_mlp {shape['d_mlp']}, context {shape['n_ctx']}, "
        f"vocabulary {shape['vocab_size']}, lm_head {'tied to the token embedding' if tied else 'untied'}",
        "",
        f"{'component':<30} {'parameters':>17} {'share':>9}",
        row("token embedding (wte)", count.token_embedding),
        row("position embedding (wpe)", count.position_embedding),
        row(f"attention QKV ({n} blocks)", count.attention_qkv),
        row(f"attention output ({n} blocks)", count.attention_output),
        row(f"MLP ({n} blocks)", count.mlp),
        row("layer norms", count.layer_norm),
        row("lm_head", count.lm_head, "(tied: shares wte)" if tied else ""),
        row("total", total),
        "",
        row("one block", count.block, f"= attention {count.block_attention:,} + MLP {count.block_mlp:,} "
                                      f"+ norms {count.block_layer_norm:,}"),
        f"total: {total:,} parameters ({total / 1e9:.3f} B)",
    ]
    return "\n".join(lines)


def add_params_arguments(parser) -> None:
    parser.add_argument("preset", nargs="?", choices=sorted(PRESETS), default="gpt2",
                        help="a known shape (default gpt2); the flags below override its dimensions")
    for flag, key in (("--n-layer", "n_layer"), ("--d-model", "d_model"), ("--n-head", "n_head"),
                      ("--d-mlp", "d_mlp"), ("--vocab", "vocab_size"), ("--n-ctx", "n_ctx")):
        parser.add_argument(flag, dest=key, type=int, help=f"override {key}")
    parser.add_argument("--untied", action="store_true", help="lm_head has its own weights")


def run_params(args) -> int:
    shape = dict(PRESETS[args.preset])
    overrides = {key: getattr(args, key) for key in shape if getattr(args, key, None) is not None}
    if "d_model" in overrides and args.d_mlp is None:
        overrides["d_mlp"] = 4 * overrides["d_model"]
    shape.update(overrides)
    bad = [key for key, value in shape.items() if value < 1]
    if bad or shape["d_model"] % shape["n_head"]:
        print(f"gpt2serve params: {', '.join(bad) or 'd_model'} must be positive"
              f"{'' if bad else ' and a multiple of n_head'}")
        return 2
    name = args.preset if not overrides else f"{args.preset} with {', '.join(f'{k}={v}' for k, v in overrides.items())}"
    print(format_table(name, shape, count_parameters(**shape, tied_lm_head=not args.untied), not args.untied))
    return 0
