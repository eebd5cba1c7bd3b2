"""Between transformers' GPT2LMHeadModel (what checkpoints hold) and our GPT2.

Names are matched one by one and every shape is checked. HF stores its projections as Conv1D,
(in, out); ours are nn.Linear, (out, in): those four weights per block are transposed once here.
transformers reads the checkpoint (safetensors, sharding, dtype); we only re-home its tensors.
"""

from __future__ import annotations

import re

import torch
from transformers import GPT2Config as HFConfig
from transformers import GPT2LMHeadModel

from ..errors import ModelLoadError
from .gpt2 import GPT2, GPT2Config

# HF parameter name -> ours; `{i}` is the block index.
NAMES = {
    "transformer.wte.weight": "wte.weight",
    "transformer.wpe.weight": "wpe.weight",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
    "transformer.h.{i}.ln_1.weight": "blocks.{i}.ln_1.weight",
    "transformer.h.{i}.ln_1.bias": "blocks.{i}.ln_1.bias",
    "transformer.h.{i}.attn.c_attn.weight": "blocks.{i}.attn.qkv.weight",
    "transformer.h.{i}.attn.c_attn.bias": "blocks.{i}.attn.qkv.bias",
    "transformer.h.{i}.attn.c_proj.weight": "blocks.{i}.attn.proj.weight",
    "transformer.h.{i}.attn.c_proj.bias": "blocks.{i}.attn.proj.bias",
    "transformer.h.{i}.ln_2.weight": "blocks.{i}.ln_2.weight",
    "transformer.h.{i}.ln_2.bias": "blocks.{i}.ln_2.bias",
    "transformer.h.{i}.mlp.c_fc.weight": "blocks.{i}.mlp.fc.weight",
    "transformer.h.{i}.mlp.c_fc.bias": "blocks.{i}.mlp.fc.bias",
    "transformer.h.{i}.mlp.c_proj.weight": "blocks.{i}.mlp.proj.weight",
    "transformer.h.{i}.mlp.c_proj.bias": "blocks.{i}.mlp.proj.bias",
}
CONV1D = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
GELU_APPROXIMATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_BLOCK = re.compile(r"\.h\.(\d+)\.")


def config_from_transformers(hf: HFConfig) -> GPT2Config:
    if hf.activation_function not in GELU_APPROXIMATIONS:
        raise ModelLoadError(f"activation {hf.activation_function!r} is not supported "
                             f"({', '.join(GELU_APPROXIMATIONS)})")
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or getattr(hf, "reorder_and_upcast_attn", False):
        raise ModelLoadError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not GPT-2 family options")
    return GPT2Config(
        n_layer=hf.n_layer, n_head=hf.n_head, d_model=hf.n_embd, d_mlp=hf.n_inner or 4 * hf.n_embd,
        n_ctx=hf.n_positions, vocab_size=hf.vocab_size, layer_norm_eps=hf.layer_norm_epsilon,
        gelu_approximate=GELU_APPROXIMATIONS[hf.activation_function],
        tie_lm_head=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def config_to_transformers(config: GPT2Config) -> HFConfig:
    activation = next(name for name, approx in GELU_APPROXIMATIONS.items() if approx == config.gelu_approximate)
    return HFConfig(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.d_model, n_inner=config.d_mlp,
                    n_positions=config.n_ctx, vocab_size=config.vocab_size, layer_norm_epsilon=config.layer_norm_eps,
                    activation_function=activation, tie_word_embeddings=config.tie_lm_head)


def our_name(hf_name: str) -> str | None:
    block = _BLOCK.search(hf_name)
    template = _BLOCK.sub(".h.{i}.", hf_name) if block else hf_name
    ours = NAMES.get(template)
    return ours.format(i=block.group(1)) if ours and block else ours


def from_transformers(hf_model: GPT2LMHeadModel) -> GPT2:
    """Our model with the checkpoint's tensors copied (same dtype and device): nothing of it
    refers to the checkpoint's memory, so the safetensors file is unmapped once transformers'
    model is dropped."""
    config = config_from_transformers(hf_model.config)
    with torch.device("meta"):
        model = GPT2(config)
    expected = dict(model.named_parameters())  # a tied lm_head is not listed: it is wte
    state = {}
    for hf_name, tensor in hf_model.named_parameters():  # a tied lm_head is listed once, as wte
        name = our_name(hf_name)
        if name is None or name not in expected:
            raise ModelLoadError(f"unexpected parameter {hf_name} in a GPT-2 checkpoint")
        tensor = tensor.detach()
        if CONV1D.fullmatch(hf_name):
            tensor = tensor.t().contiguous()  # Conv1D (in, out) -> Linear (out, in)
        else:  # our own copy: a view would keep the checkpoint's file mapped (and resident) for life
            tensor = tensor.clone()
        if tensor.shape != expected[name].shape:
            raise ModelLoadError(f"{hf_name}: shape {list(tensor.shape)}, expected {list(expected[name].shape)}")
        state[name] = tensor
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def to_transformers(model: GPT2) -> GPT2LMHeadModel:
    """transformers' model with our weights (fp32, CPU; sharing storage where it can): for
    `save_pretrained`, and for the tests, which judge our forward against transformers' own."""
    with torch.device("meta"):
        hf_model = GPT2LMHeadModel(config_to_transformers(model.config))  # no random init to pay for
    ours = dict(model.named_parameters())
    state = {}
    for hf_name, _ in hf_model.named_parameters():
        tensor = ours[our_name(hf_name)].detach().float().cpu()
        state[hf_name] = tensor.t().contiguous() if CONV1D.fullmatch(hf_name) else tensor
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: set below
    hf_model.tie_weights()
    return hf_model.eval().requires_grad_(False)
