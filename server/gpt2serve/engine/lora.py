"""LoRA adapters in peft's format, chosen per row of a forward (Punica's and S-LoRA's way, never
by merging weights into the base).

An adapter adds to a Linear's output y = W x + b the low-rank term  scale * B (A x),  with A
(r, in) and B (out, r) for each module it targets. GPT-2's targets, in peft's (Hugging Face's)
names and ours:

    attn.c_attn -> attn.qkv    attn.c_proj -> attn.proj    mlp.c_fc -> mlp.fc    mlp.c_proj -> mlp.proj

HF's GPT-2 keeps these as Conv1D (weights stored (in, out), peft's `fan_in_fan_out`); peft's
lora_A and lora_B are plain Linear layers either way, so A is (r, in) and B (out, r) for both.
`scale` is lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; `alpha_pattern` and
`rank_pattern` set them per module. Dropout does nothing at inference. Everything else peft can
save that changes the forward (DoRA, `modules_to_save`, LoRA biases, embedding adapters, another
model's shapes) is refused at load, by name.

A forward's rows each name an adapter or none (the base). `AdapterRows` knows which tokens take
which adapter; each targeted projection then adds every token's term in two GEMMs (below). A
forward without adapter rows runs exactly as before (no AdapterRows at all).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import torch

from ..errors import InvalidArgument
from .gpt2 import GPT2Config

# peft's module name -> ours (engine.gpt2)
TARGETS = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
TARGET_NAMES = ("c_attn", "c_proj", "c_fc")
DEFAULT_MAX_RANK = 64
# A forward whose adapter tokens lie in runs this long on average (prompt rows) adds each adapter
# on its own run; shorter (decode steps, one token a row) adds every adapter to every token, masked.
RUN_TOKENS = 8
_KEY = re.compile(r"(?:^|\.)h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_uids = itertools.count(1)


class Keeper(Protocol):
    """What keeps adapters in memory (engine.lora_registry.LoraRegistry): `ready` before a forward."""

    def ready(self, adapters: Sequence[LoraAdapter]) -> None: ...


class AdapterError(InvalidArgument):
    """An adapter that cannot be served: the message names the file, field or module at fault."""


@dataclass(eq=False)  # compared by identity: two loads of one directory are two adapters
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules'
    # (layer, our module name) -> (A (r, in), B (out, r) times its scale), fp32; None: out of
    # memory (--max-cpu-loras), read again from `path` when next used (LoraRegistry.ready)
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None
    targets: tuple[str, ...]  # peft's module names it adapts, e.g. ("c_attn", "c_fc")
    uid: int = field(default_factory=lambda: next(_uids))  # its prefix-cache root (engine.prefix_cache)
    keeper: Keeper | None = None  # the registry that keeps it in memory, or drops it

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in (self.weights or {}).values())

    def __str__(self) -> str:  # for the log: what was loaded, and from where
        return (f"LoRA adapter {self.name!r}: rank {self.rank} on {', '.join(self.targets)}, "
                f"{self.nbytes / 2**20:.1f} MiB, from {self.path}")


def shapes(config: GPT2Config) -> dict[str, tuple[int, int]]:
    """Our module name -> (out, in) of its weight."""
    C, M = config.d_model, config.d_mlp
    return {"attn.qkv": (3 * C, C), "attn.proj": (C, C), "mlp.fc": (M, C), "mlp.proj": (C, M)}


def load_adapter(name: str, path: str | Path, config: GPT2Config, max_rank: int = DEFAULT_MAX_RANK,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """A peft LoRA directory (adapter_config.json, then adapter_model.safetensors or .bin) for a
    model of `config`'s shapes. Raises AdapterError naming what it refuses."""
    where = Path(path)
    settings = _read_config(where)
    tensors = _read_weights(where)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: {where}: the weight {key!r} is not a LoRA A or B of GPT-2's "
                               f"c_attn, c_proj or c_fc (embedding adapters, modules_to_save and LoRA biases "
                               f"are not supported)")
        layer, module, side = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {where}: no LoRA weights in the file")
    expected = shapes(config)
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        where_in = f"adapter {name!r}: h.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where_in}: lora_{'B' if 'A' in pair else 'A'} is missing")
        if layer >= config.n_layer:
            raise AdapterError(f"{where_in}: the model has {config.n_layer} layers (another base model?)")
        a, b = pair["A"], pair["B"]
        out_features, in_features = expected[TARGETS[module]]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where_in}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                               f"the base's ({out_features}, {in_features}) weight (another base model?)")
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"{where_in}: rank {rank} is over --max-lora-rank {max_rank}")
        scale = _scale(settings, f"h.{layer}.{module}", rank)
        weights[(layer, TARGETS[module])] = (a.to(device, torch.float32).contiguous(),
                                             (b.to(torch.float32) * scale).to(device).contiguous())
    modules = sorted({m.split(".")[1] for _, m in pairs}, key=TARGET_NAMES.index)
    return LoraAdapter(name, str(where), max(a.shape[0] for a, _ in weights.values()), weights, tuple(modules))


def _read_config(where: Path) -> dict:
    config_file = where / "adapter_config.json"
    try:
        settings = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{where}: no adapter_config.json (not a peft adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file}: not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{config_file}: not a JSON object")
    refused = {
        "peft_type": settings.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(settings.get("use_dora")),
        "modules_to_save": bool(settings.get("modules_to_save")),
        "bias": settings.get("bias", "none") != "none",
        "lora_bias": bool(settings.get("lora_bias")),
        "layer_replication": bool(settings.get("layer_replication")),
        "target_parameters": bool(settings.get("target_parameters")),
    }
    for key, bad in refused.items():
        if bad:
            raise AdapterError(f"{config_file}: {key}={settings.get(key)!r} is not supported (plain LoRA on "
                               f"c_attn, c_proj and c_fc only)")
    for key in ("r", "lora_alpha"):
        value = settings.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"{config_file}: {key} must be a positive number, not {value!r}")
    targets = settings.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets or []
    unknown = [t for t in names if isinstance(targets, list) and t.split(".")[-1] not in TARGET_NAMES]
    if unknown:
        raise AdapterError(f"{config_file}: target_modules {unknown} are not supported (GPT-2's c_attn, c_proj "
                           f"and c_fc only)")
    return settings


def _read_weights(where: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = where / "adapter_model.safetensors", where / "adapter_model.bin"
    try:
        if safetensors_file.exists():
            from safetensors.torch import load_file
            return load_file(str(safetensors_file))
        if bin_file.exists():
            loaded = torch.load(bin_file, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                raise ValueError("not a mapping of names to tensors")
            return loaded
    except Exception as exc:  # a truncated or foreign file: the library's own words
        raise AdapterError(f"{where}: the adapter's weights are not readable ({type(exc).__name__}: {exc})") from None
    raise AdapterError(f"{where}: no adapter_model.safetensors or adapter_model.bin")


def _scale(settings: dict, module: str, rank: int) -> float:
    """lora_alpha (or its alpha_pattern entry for this module) over r, or over sqrt(r) (rsLoRA)."""
    alpha = settings["lora_alpha"]
    for pattern, value in (settings.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            alpha = value
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _runs(adapters: Sequence[LoraAdapter | None], counts: Sequence[int]) -> list[tuple[int, int, LoraAdapter]]:
    """Tokens [start, end) under one adapter each, neighbouring rows of one adapter merged."""
    runs, start = [], 0
    for adapter, count in zip(adapters, counts):
        if adapter is not None:
            if runs and runs[-1][2] is adapter and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + count, adapter)
            else:
                runs.append((start, start + count, adapter))
        start += count
    return runs


class AdapterRows:
    """Which tokens of one forward take which adapter, and their terms. engine.gpt2 calls `add`
    after each targeted projection.

    Where each adapter's tokens lie in long runs (prompt rows), each run takes its adapter's A and
    B on its own tokens (`_add_runs`). Otherwise (decode steps: a token a row) each adapter's A
    shrinks every token into its r rows of (K r, N), masked to each token's own adapter; one GEMM
    then adds every B side by side (out, K r) times that to the output, in place: Punica's shrink
    and expand as dense GEMMs, K times the shrink's few FLOPs, in a handful of calls whatever the
    rows, and tensors a decode trace can take as inputs (`trace_inputs`). A pass per adapter over
    the whole output, or a term tensor added after, cost more on a CPU than the adapters'
    arithmetic (bench/engine/lora_mixed.py; docs/benchmarks.md, "LoRA adapters")."""

    _stacks: tuple[tuple, dict] = ((), {})  # the last forward's adapters and their stacks: decode steps repeat

    def __init__(self, adapters: Sequence[LoraAdapter], mask: torch.Tensor | None,
                 runs: Sequence[tuple[int, int, LoraAdapter]] = ()):
        self.adapters, self.mask = tuple(adapters), mask  # mask (K r, N): 1 in each token's adapter's rows
        self.runs = runs  # or, tokens [start, end) under one adapter each (the rest: the base)
        self.rank = max(a.rank for a in adapters)
        if runs:  # no stacks: the decode steps' cached ones stay for the next step
            return
        if AdapterRows._stacks[0] != self.adapters:
            AdapterRows._stacks = (self.adapters, {})
        self.stacks = AdapterRows._stacks[1]  # (layer, module, dtype) -> (A's (K r, in), B's (out, K r))

    @classmethod
    def of(cls, adapters: Sequence[LoraAdapter | None], lengths: Sequence[int] | int,
           device: torch.device) -> AdapterRows | None:
        """Row i's `lengths[i]` tokens (an int: every row's) take `adapters[i]`, rows laid end to
        end; None when no row has one. By runs only with a length each (prompt rows), so decode
        steps (an int) always have the mask their traces take."""
        if not any(adapters):
            return None
        distinct = list(dict.fromkeys(a for a in adapters if a is not None))
        if distinct[0].keeper is not None:
            distinct[0].keeper.ready(distinct)
        if len(set(adapters)) == 1:  # one adapter for every token: nothing to mask
            return cls([adapters[0]], None)
        counts = [lengths] * len(adapters) if isinstance(lengths, int) else lengths
        runs = [] if isinstance(lengths, int) else _runs(adapters, counts)  # an int: decode rows or a padded batch
        if len(distinct) > 1 and runs and sum(e - s for s, e, _ in runs) >= RUN_TOKENS * len(runs):
            return cls(distinct, None, runs)  # long runs (prompt rows): each adapter on its own tokens
        column = {a: k for k, a in enumerate(distinct)}
        owner = torch.tensor([column[a] if a is not None else -1 for a in adapters]).repeat_interleave(
            torch.tensor(counts))  # (N,) each token's adapter, -1: the base
        rank = max(a.rank for a in distinct)
        mask = (torch.arange(len(distinct) * rank)[:, None] // rank == owner[None, :]).float()  # (K r, N)
        return cls(distinct, mask.to(device))

    def trace_inputs(self, n_layer: int, dtype: torch.dtype) -> tuple[tuple, list[torch.Tensor]]:
        """What a decode trace takes of this forward (engine.traced_decode): its signature (the
        adapters' count and rank, the projections any targets, a mask or not), the same for every
        set of adapters alike, and its tensors, the mask (if any) then each projection's stacks.
        Decode rows only (`of` with an int length): runs are never traced."""
        assert not self.runs, "a forward by runs has no mask a trace could take"
        keys = [(layer, module, dtype) for layer in range(n_layer) for module in TARGETS.values()]
        present = [key for key in keys if self._stacks_for(*key) is not None]
        tensors = [t for key in present for t in self.stacks[key]]
        signature = (len(self.adapters), self.rank, tuple(present), self.mask is not None)
        return signature, ([self.mask] if self.mask is not None else []) + tensors

    @classmethod
    def traced(cls, signature: tuple, n_layer: int, tensors: Sequence[torch.Tensor]) -> AdapterRows:
        """The rows of a trace's forward, from trace_inputs' signature and tensors (the trace's
        inputs): the stacks and mask come in as they are, nothing is stacked or looked up."""
        count, rank, present, masked = signature
        rows = cls.__new__(cls)
        rows.adapters, rows.rank, rows.runs = (None,) * count, rank, ()
        rows.mask, tensors = (tensors[0], tensors[1:]) if masked else (None, tensors)
        dtype = present[0][2]  # every stack's: the forward's
        rows.stacks = {(layer, module, dtype): None for layer in range(n_layer) for module in TARGETS.values()}
        rows.stacks.update({key: (tensors[2 * i], tensors[2 * i + 1]) for i, key in enumerate(present)})
        return rows

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (..., in) the projection's input, y (..., out) its output (the caller's own, changed in
        place) -> y plus each token's adapter term (the shrink in fp32, the expand in y's dtype)."""
        if self.runs:
            return self._add_runs(layer, module, x, y)
        stacks = self._stacks_for(layer, module, y.dtype)
        if stacks is None:  # no adapter here targets this projection
            return y
        a, b = stacks  # (K r, in) fp32, (out, K r)
        out = y.reshape(-1, y.shape[-1])  # (N, out): a view of y where one can be, else a copy
        rows, r = x.reshape(-1, x.shape[-1]).float(), self.rank
        # One (r, N) GEMM an adapter, not one for all K: a GEMM's sums may be ordered by its shape,
        # and a row's answer must not depend on which adapters share its forward (int8's
        # activation rounding turns an ulp into 1e-4). A @ x^T, as engine.gpt2.Linear computes on
        # a CPU: x @ A^T's narrow output falls off MKL's cliff (3x slower).
        h = torch.cat([a[k * r:(k + 1) * r] @ rows.T for k in range(len(self.adapters))])  # (K r, N)
        if self.mask is not None:
            h *= self.mask
        h = h.to(y.dtype)
        if out.T.is_contiguous():  # Linear's transposed output on a CPU: (out, N) is the memory's order
            out.T.addmm_(b, h)
        else:
            out.addmm_(h.T, b.T)
        return out.reshape(y.shape)

    def _add_runs(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each run's adapter on the run's own tokens, r rows of GEMM each: what S-LoRA's segments
        compute, without a gather (a run's tokens are a slice) or a scatter (its part of the
        output is a strided view BLAS writes in place). K adapters in one forward cost one
        adapter's FLOPs, not K times them as the mask does; it takes runs long enough that a
        GEMM's call is not the cost (RUN_TOKENS)."""
        out = y.reshape(-1, y.shape[-1])  # (N, out)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        transposed = out.T.is_contiguous()  # Linear's output on a CPU: (out, N) in memory
        for start, end, adapter in self.runs:
            pair = adapter.weights.get((layer, module))
            if pair is None:  # this adapter leaves the projection alone
                continue
            a, b = pair  # (r, in) fp32, (out, r) fp32, scaled
            h = (a @ rows[start:end].float().T).to(y.dtype)  # (r, n)
            if transposed:
                out.T[:, start:end].addmm_(b.to(y.dtype), h)  # (out, n): a view with row stride N
            else:
                out[start:end].addmm_(h.T, b.to(y.dtype).T)
        return out.reshape(y.shape)

    def _stacks_for(self, layer: int, module: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every adapter's A and B (scaled) side by side, r rows or columns each, zero where its rank
        or its targets leave them: ((K r, in) fp32, (out, K r) in `dtype`); None where none targets it."""
        key = (layer, module, dtype)
        if key not in self.stacks:
            pairs = [adapter.weights.get((layer, module)) for adapter in self.adapters]
            present = [p for p in pairs if p is not None]
            stacked = None
            if present:
                r, (a0, b0) = self.rank, present[0]
                a = torch.zeros(len(pairs) * r, a0.shape[1], dtype=torch.float32, device=a0.device)
                b = torch.zeros(b0.shape[0], len(pairs) * r, dtype=dtype, device=b0.device)
                for k, pair in enumerate(pairs):
                    if pair is not None:
                        a[k * r:k * r + len(pair[0])] = pair[0]
                        b[:, k * r:k * r + len(pair[0])] = pair[1]
                stacked = (a, b)
            self.stacks[key] = stacked
        return self.stacks[key]
