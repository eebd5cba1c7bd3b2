"""LoRA adapters made with peft itself, saved in its format, and peft's unmerged forward as the
judge: three adapters of different ranks and target modules, random non-zero weights (peft
starts B at zero, which would make every adapter the base)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2LMHeadModel

# name -> (rank, target modules, lora_alpha, rsLoRA)
ADAPTERS = {
    "poet": (4, ["c_attn"], 8, False),
    "coder": (8, ["c_attn", "c_proj", "c_fc"], 16, False),
    "critic": (2, ["c_fc", "c_proj"], 4, True),
}


def make_adapter(base_dir: Path, out_dir: Path, rank: int, targets: list[str], alpha: float, rslora: bool,
                 seed: int, safetensors: bool = True, **extra) -> Path:
    """A peft LoRA adapter for the checkpoint at `base_dir`, with seeded random A and B, saved to `out_dir`."""
    base = GPT2LMHeadModel.from_pretrained(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.1, use_rslora=rslora,
                        fan_in_fan_out=True, task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=safetensors)
    return out_dir


def make_adapters(base_dir: Path, directory: Path) -> dict[str, Path]:
    """ADAPTERS, each in a directory of its own under `directory`."""
    return {name: make_adapter(base_dir, directory / name, rank, targets, alpha, rslora, seed)
            for seed, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items())}


def peft_model(base_dir: Path, adapter_dir: Path) -> PeftModel:
    """peft's model of the adapter over a fresh copy of the base, unmerged, dropout off (eval)."""
    return PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base_dir), adapter_dir).eval()


def peft_blocks(model, prompt, base: bool) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
    """peft's forward of `prompt` (with its adapter off when `base`): at the last position, the
    residual stream after each block and each block's attention and MLP outputs; and the logits."""
    captured = {"hidden": [], "attn": [], "mlp": []}
    first = lambda output: output[0] if isinstance(output, tuple) else output  # noqa: E731
    hooks = []
    for block in model.base_model.model.transformer.h:
        hooks.append(block.register_forward_hook(lambda m, i, o: captured["hidden"].append(first(o)[0, -1])))
        hooks.append(block.attn.register_forward_hook(lambda m, i, o: captured["attn"].append(first(o)[0, -1])))
        hooks.append(block.mlp.register_forward_hook(lambda m, i, o: captured["mlp"].append(first(o)[0, -1])))
    try:
        with torch.no_grad(), model.disable_adapter() if base else contextlib.nullcontext():
            logits = model(torch.tensor([prompt])).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return captured, logits


def peft_shifts(model, prompt) -> list[tuple[float, float, float]]:
    """Per block, ||adapter - base|| / ||base|| of the residual, attention and MLP outputs, by peft."""
    (adapted, _), (base, _) = peft_blocks(model, prompt, base=False), peft_blocks(model, prompt, base=True)
    return [tuple(float((adapted[k][i] - base[k][i]).norm() / base[k][i].norm()) for k in ("hidden", "attn", "mlp"))
            for i in range(len(base["hidden"]))]

