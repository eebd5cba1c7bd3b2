"""Resolve `--model`, `--device` and `--dtype` into a ready model and tokenizer.

`--model` is one of:
- `random:<arch>`: that architecture with seeded random weights (tests, benchmarks, demos);
- a local directory holding a GPT-2 family checkpoint (`save_pretrained` output);
- a Hugging Face id (`gpt2`, `distilgpt2`, ...), taken from the local cache or the hub.

transformers reads checkpoints; what is served is always our own GPT2 (engine.gpt2).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from gpt2serve_client.types import ParameterBreakdown

from ..errors import ModelLoadError
from ..introspection.params import PRESETS, SERVABLE
from .convert import read_checkpoint_dir
from .gpt2 import GPT2, GPT2Config
from .model_info import parameter_breakdown
from .quantize import MODES as QUANTIZE_MODES, quantize as quantize_model
from .tokenizer import Tokenizer, bundled_gpt2_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
# Shapes of the GPT-2 family (params.PRESETS); all share GPT-2's 50257-token vocabulary.
ARCHITECTURES: dict[str, GPT2Config] = {
    name: GPT2Config(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, d_mlp=a.d_mlp, n_ctx=a.n_ctx,
                     vocab_size=a.vocab_size) for name, a in ((name, PRESETS[name]) for name in SERVABLE)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class LoadedModel:
    model: GPT2
    tokenizer: Tokenizer
    name: str  # --model as given
    weights: str  # "pretrained" | "random"
    weights_source: str
    device: torch.device
    dtype: torch.dtype  # of activations and compute (and of the weights, unless quantized)
    parameters: ParameterBreakdown  # counted before quantizing (packed weights are not Parameters)
    quantize: str = "none"  # engine.quantize.MODES


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype {dtype}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def random_config(arch: str) -> GPT2Config:
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"random:{arch}: unknown architecture; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def build_random_model(arch: str, seed: int) -> GPT2:
    """The same (arch, seed) always gives the same model (fp32, CPU)."""
    return GPT2.random(random_config(arch), seed)


def build_model_like(info) -> LoadedModel:
    """Random weights with the architecture, dtype and device a server reports (for benchmarks)."""
    a = info.architecture
    config = GPT2Config(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, d_mlp=a.d_mlp,
                        n_ctx=a.n_ctx, vocab_size=a.vocab_size)
    device, dtype = torch.device(info.device), DTYPES[info.dtype]
    model = GPT2.random(config, seed=0).to(device=device, dtype=dtype)
    return LoadedModel(model, bundled_gpt2_tokenizer(), f"like:{info.model}", "random", "bench", device, dtype,
                       parameter_breakdown(model))


def hub_reachable() -> bool:
    """A quick TCP probe, so an offline machine fails in seconds, not after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_snapshot(spec: str, allow_pickle: bool, offline: bool) -> Path:
    """A hub model's files in the local Hugging Face cache (downloading them unless `offline`)."""
    from huggingface_hub import snapshot_download  # lazy: only hub ids need it

    patterns = ["*.json", "*.safetensors", *(["pytorch_model*.bin"] if allow_pickle else []), "*.txt"]
    return Path(snapshot_download(spec, allow_patterns=patterns, local_files_only=offline))


def load_pretrained(spec: str, dtype: torch.dtype, allow_pickle: bool = False) -> tuple[GPT2, Tokenizer, str]:
    """Never runs code from the checkpoint: no remote code, and safetensors only unless
    `allow_pickle` (then safetensors is still preferred, and torch.load is weights-only)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return read_checkpoint_dir(path, dtype, allow_pickle), load_tokenizer(path), str(path.resolve())
    if spec.startswith((".", "/", "~")):  # Meant as a path, not a hub id.
        raise ModelLoadError(f"{spec}: no such checkpoint directory")
    from huggingface_hub.errors import HFValidationError

    try:  # Local hub cache first: no network needed.
        snapshot = hub_snapshot(spec, allow_pickle, offline=True)
    except (OSError, ValueError, HFValidationError):
        if not hub_reachable():
            raise ModelLoadError(f"{spec}: not in the local cache and the Hugging Face hub is unreachable")
        try:
            snapshot = hub_snapshot(spec, allow_pickle, offline=False)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{spec}: could not load from the Hugging Face hub: {exc}") from exc
    try:
        model = read_checkpoint_dir(snapshot, dtype, allow_pickle)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{spec}: {exc}") from exc
    return model, bundled_gpt2_tokenizer(), f"huggingface:{spec}"


def check_quantize(quantize: str, device: torch.device, dtype: torch.dtype) -> None:
    if quantize not in QUANTIZE_MODES:
        raise ModelLoadError(f"--quantize {quantize}: expected one of {', '.join(QUANTIZE_MODES)}")
    if quantize == "none":
        return
    if device.type != "cpu":
        raise ModelLoadError(f"--quantize {quantize} runs on CPUs only (fbgemm kernels); on {device.type} "
                             "use --dtype float16 or bfloat16 for smaller weights")
    if dtype != torch.float32:
        raise ModelLoadError(f"--quantize {quantize} computes in float32; drop --dtype {str(dtype)[6:]} "
                             "(or pass float32)")


def release_freed_memory() -> None:
    """Give the fp32 weights' freed pages back to the OS: glibc keeps freed heap blocks below
    its mmap threshold (32 MiB at most), so a quantized model would otherwise keep the RSS of fp32."""
    try:
        import ctypes  # lazy: only quantizing needs it
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def load_model(spec: str, device: str = "auto", dtype: str = "auto", *, seed: int = 0,
               random_fallback: bool = False, allow_pickle: bool = False, quantize: str = "none") -> LoadedModel:
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    check_quantize(quantize, torch_device, torch_dtype)
    if spec.startswith(RANDOM_PREFIX):
        arch = spec[len(RANDOM_PREFIX):]
        model, tokenizer = build_random_model(arch, seed), bundled_gpt2_tokenizer()
        weights, source = "random", f"random:{arch} (seed {seed})"
    else:
        try:
            model, tokenizer, source = load_pretrained(spec, torch_dtype, allow_pickle)
            weights = "pretrained"
        except ModelLoadError as exc:
            if not (random_fallback and spec in ARCHITECTURES):
                raise
            log.warning(
                "\n%s\n!! %s\n!! FALLING BACK TO RANDOM WEIGHTS (random:%s, seed %d): answers are "
                "meaningless.\n!! Pass --random-fallback=false to fail instead.\n%s",
                "!" * 78, exc, spec, seed, "!" * 78,
            )
            model, tokenizer = build_random_model(spec, seed), bundled_gpt2_tokenizer()
            weights, source = "random", f"random:{spec} (seed {seed}; fallback: {exc})"
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}"
        )
    model = model.to(device=torch_device, dtype=torch_dtype)
    parameters = parameter_breakdown(model)
    if quantize != "none":
        model = quantize_model(model, quantize)
        release_freed_memory()
    return LoadedModel(model, tokenizer, spec, weights, source, torch_device, torch_dtype, parameters, quantize)
