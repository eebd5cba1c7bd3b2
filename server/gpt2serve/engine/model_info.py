"""Describe a loaded model: architecture and parameter counts by component."""

from __future__ import annotations

from gpt2serve_client.types import Architecture, ParameterBreakdown

from .gpt2 import GPT2, GPT2Config

# Parameter-name prefixes -> breakdown field. Names look like `blocks.3.attn.qkv.weight`.
COMPONENTS = (
    ("wte.", "token_embedding"),
    ("wpe.", "position_embedding"),
    ("blocks.*.attn.qkv.", "attention_qkv"),
    ("blocks.*.attn.proj.", "attention_output"),
    ("blocks.*.mlp.", "mlp"),
    ("blocks.*.ln_", "layer_norm"),
    ("ln_f.", "layer_norm"),
    ("lm_head.", "lm_head"),
)


def architecture(config: GPT2Config) -> Architecture:
    return Architecture(
        n_layer=config.n_layer, n_head=config.n_head, d_model=config.d_model, d_head=config.d_head,
        d_mlp=config.d_mlp, n_ctx=config.n_ctx, vocab_size=config.vocab_size,
    )


def component(name: str) -> str:
    parts = name.split(".")
    generic = ".".join(["blocks", "*", *parts[2:]]) if parts[0] == "blocks" else name
    field = next((f for prefix, f in COMPONENTS if generic.startswith(prefix)), None)
    if field is None:
        raise ValueError(f"parameter {name} fits no component of the GPT-2 breakdown")
    return field


def parameter_breakdown(model: GPT2) -> ParameterBreakdown:
    """Counts each distinct tensor once, so a tied lm_head (GPT-2's) adds nothing."""
    counts = {field: 0 for _, field in COMPONENTS}
    # named_parameters() skips tensors already seen, which is how tying shows up.
    for name, param in model.named_parameters():
        counts[component(name)] += param.numel()
    return ParameterBreakdown(**counts, total=sum(counts.values()))
