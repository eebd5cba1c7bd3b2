"""Describe a loaded model: architecture and parameter counts by component."""

from __future__ import annotations

from gpt2serve_client.types import Architecture, ParameterBreakdown
from transformers import GPT2LMHeadModel

# Parameter-name fragments -> breakdown field. Names look like `transformer.h.3.attn.c_attn.weight`.
COMPONENTS = (
    (".wte.", "token_embedding"),
    (".wpe.", "position_embedding"),
    (".attn.c_attn.", "attention_qkv"),
    (".attn.c_proj.", "attention_output"),
    (".mlp.", "mlp"),
    (".ln_", "layer_norm"),
    ("lm_head.", "lm_head"),
)


def architecture(model: GPT2LMHeadModel) -> Architecture:
    c = model.config
    return Architecture(
        n_layer=c.n_layer, n_head=c.n_head, d_model=c.n_embd, d_head=c.n_embd // c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd, n_ctx=c.n_positions, vocab_size=c.vocab_size,
    )


def parameter_breakdown(model: GPT2LMHeadModel) -> ParameterBreakdown:
    """Counts each distinct tensor once, so a tied lm_head (GPT-2's) adds nothing."""
    counts = {field: 0 for _, field in COMPONENTS}
    # named_parameters() skips tensors already seen, which is how tying shows up.
    for name, param in model.named_parameters():
        field = next((f for fragment, f in COMPONENTS if fragment in "." + name), None)
        if field is None:
            raise ValueError(f"parameter {name} fits no component of the GPT-2 breakdown")
        counts[field] += param.numel()
    return ParameterBreakdown(**counts, total=sum(counts.values()))
