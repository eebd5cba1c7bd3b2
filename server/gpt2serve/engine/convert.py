"""Between Hugging Face GPT-2 checkpoints (transformers' GPT2LMHeadModel) and our GPT2.

Names are matched one by one and every shape is checked. HF stores its projections as Conv1D,
(in, out); ours are nn.Linear, (out, in): those four weights per block are transposed once here.

A checkpoint directory is read here directly (config.json through transformers' GPT2Config, the
tensors with safetensors, or torch.load weights-only where pickle is allowed), not through
GPT2LMHeadModel.from_pretrained: importing transformers' modeling code costs a server about
130 MB of memory for its whole life (GPT-2 small int8 holds about 600 MB in all).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import GPT2Config as HFConfig

if TYPE_CHECKING:
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


IGNORED = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")  # old checkpoints' causal-mask buffers


def full_name(hf_name: str) -> str:
    """Checkpoints saved from transformers' GPT2Model (the hub's own gpt2) name no prefix."""
    return hf_name if hf_name.startswith(("transformer.", "lm_head.")) else f"transformer.{hf_name}"


def our_name(hf_name: str) -> str | None:
    block = _BLOCK.search(hf_name)
    template = _BLOCK.sub(".h.{i}.", hf_name) if block else hf_name
    ours = NAMES.get(template)
    return ours.format(i=block.group(1)) if ours and block else ours


def from_transformers(hf_model: GPT2LMHeadModel) -> GPT2:
    """Our model with the tensors of transformers' model copied (same dtype and device)."""
    return from_tensors(config_from_transformers(hf_model.config), dict(hf_model.named_parameters()))  # tied: wte once


PICKLE_HINT = "unpickling can run code: convert the checkpoint to safetensors, or pass --allow-pickle if you trust it"


# What a checkpoint directory holds, named in every error about one (docs/fine-tuned.md).
SAVED_FILES_HINT = ("a checkpoint directory holds what `model.save_pretrained(dir)` writes: config.json and "
                    "model.safetensors (and the tokenizer's vocab.json and merges.txt, from "
                    "`tokenizer.save_pretrained(dir)`); see docs/fine-tuned.md")


def read_checkpoint_dir(path: Path, dtype: torch.dtype, allow_pickle: bool) -> GPT2:
    """A GPT-2 checkpoint directory (config.json, then *.safetensors, sharded or not; or
    pytorch_model*.bin where `allow_pickle`, loaded weights-only) -> our model in `dtype`."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json; {SAVED_FILES_HINT}")
    try:
        hf_config = HFConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: config.json does not load: {reason}") from exc
    if hf_config.model_type != "gpt2":
        raise ModelLoadError(f"{path}: model_type {hf_config.model_type!r} is not GPT-2 family")
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open  # lazy: only checkpoints need it

        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name).to(dtype) for name in handle.keys()})
    elif allow_pickle and (files := sorted(path.glob("pytorch_model*.bin"))):
        for file in files:
            tensors.update({name: t.to(dtype) for name, t in torch.load(file, map_location="cpu",
                                                                        weights_only=True).items()})
    elif allow_pickle:
        raise ModelLoadError(f"{path}: not a loadable GPT-2 checkpoint: no *.safetensors or pytorch_model*.bin file")
    elif any(path.glob("*.bin")):
        raise ModelLoadError(f"{path}: only pickle weights (pytorch_model.bin) were found, and {PICKLE_HINT}")
    else:  # a hub snapshot fetched without --allow-pickle holds no .bin even where the repository has one
        raise ModelLoadError(f"{path}: no weights (no *.safetensors file); {SAVED_FILES_HINT}. A checkpoint with "
                             f"pickle weights (pytorch_model.bin) only: {PICKLE_HINT}")
    return from_tensors(config_from_transformers(hf_config), tensors)


def from_tensors(config: GPT2Config, named: dict[str, torch.Tensor]) -> GPT2:
    """Our model from HF-named tensors (same dtype and device; `named` is emptied), each copied:
    nothing of it refers to the checkpoint's memory, so a safetensors file is unmapped after."""
    with torch.device("meta"):
        model = GPT2(config)
    expected = dict(model.named_parameters())  # a tied lm_head is not listed: it is wte
    state = {}
    while named:  # taken out one at a time: the checkpoint's copy and ours never both held whole
        hf_name, tensor = named.popitem()
        hf_name = full_name(hf_name)
        if IGNORED.fullmatch(hf_name):
            continue
        if config.tie_lm_head and hf_name == "lm_head.weight":
            continue  # the same tensor as wte
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
    from transformers import GPT2LMHeadModel  # lazy: a server never needs transformers' modeling code

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
