"""Decoder-only transformer shapes, from GPT-1 to DeepSeek-V3: what `gpt2serve params` counts and
what /ui draws without weights.

An `Architecture` names each dimension and each departure from GPT-2: grouped-query attention
(fewer key/value heads than query heads), SwiGLU MLPs (gate, up and down matrices), RMSNorm (a
gain, no bias), rotary positions (no parameters), untied LM heads, mixtures of experts (shared
and routed, a few routed experts active per token) and multi-head latent attention (keys and
values rebuilt from one small latent per token). `from_hf_config` reads a Hugging Face
config.json of these families. No torch here: the command starts at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class MixtureOfExperts:
    n_routed: int  # routed experts per MoE layer
    n_shared: int  # experts every token goes through
    top_k: int  # routed experts each token is sent to
    d_expert: int  # each expert's hidden size (a SwiGLU MLP)
    first_dense: int  # the first layers keep a dense MLP


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's MLA: queries through a rank-q_rank bottleneck (or one matrix when 0); keys and
    values from one kv_rank latent per token (that latent and a shared rotary key are the cache)."""

    q_rank: int  # 0: a plain query projection
    kv_rank: int
    d_nope: int  # per-head query/key width without position
    d_rope: int  # per-head query/key width that carries rotary positions
    d_value: int  # per-head value width


@dataclass(frozen=True)
class Architecture:
    family: str
    n_layer: int
    d_model: int
    n_head: int
    d_mlp: int  # the dense MLP's hidden size
    vocab_size: int
    n_ctx: int
    n_kv_head: int = 0  # 0: as many as query heads; fewer is grouped-query attention
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    biases: str = "all"  # "all" (GPT), "qkv" (Qwen 2), "none"
    positions: str = "learned"  # or "rope"
    tied_lm_head: bool = True
    final_norm: bool = True  # GPT-1 normalises after each sublayer and has no final norm
    moe: MixtureOfExperts | None = None
    mla: LatentAttention | None = None
    # The published count, as its source gives it: "7.61B" (rounded) or "124,439,808" (exact).
    published: str = ""
    published_active: str = ""  # mixtures of experts: parameters a token goes through
    published_non_embedding: str = ""
    source: str = ""  # where those figures are published
    card_note: str = ""  # where the source disagrees with its own config.json

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense

    def describe(self) -> str:
        parts = [f"{self.n_layer} layers", f"d_model {self.d_model}"]
        if self.mla:
            parts.append(f"{self.n_head} heads with latent attention (q rank {self.mla.q_rank or 'full'}, "
                         f"kv rank {self.mla.kv_rank})")
        elif self.kv_heads != self.n_head:
            parts.append(f"{self.n_head} query heads of {self.d_head}, {self.kv_heads} key/value heads")
        else:
            parts.append(f"{self.n_head} heads of {self.d_head}")
        parts.append(f"{self.mlp.upper() if self.mlp == 'gelu' else 'SwiGLU'} MLP {self.d_mlp}")
        if self.moe:
            m = self.moe
            parts.append(f"MoE from layer {m.first_dense}: {m.n_routed} routed experts (top {m.top_k}) + "
                         f"{m.n_shared} shared, each {m.d_expert} wide")
        parts += [f"{'RMSNorm' if self.norm == 'rmsnorm' else 'LayerNorm'}",
                  f"{'rotary' if self.positions == 'rope' else 'learned'} positions", f"context {self.n_ctx}",
                  f"vocabulary {self.vocab_size}", f"lm_head {'tied' if self.tied_lm_head else 'untied'}"]
        return ", ".join(parts)


def _gpt(n_layer, d_model, n_head, n_ctx=1024, vocab_size=50257, **kw) -> Architecture:
    return Architecture("gpt2", n_layer, d_model, n_head, 4 * d_model, vocab_size, n_ctx, **kw)


def _llama(n_layer, d_model, n_head, n_kv_head, d_mlp, vocab_size, n_ctx, **kw) -> Architecture:
    return Architecture("llama", n_layer, d_model, n_head, d_mlp, vocab_size, n_ctx, n_kv_head=n_kv_head,
                        norm="rmsnorm", mlp="swiglu", biases="none", positions="rope", tied_lm_head=False, **kw)


def _qwen(n_layer, d_model, n_head, n_kv_head, d_mlp, tied, vocab_size=152064, n_ctx=32768, **kw) -> Architecture:
    return replace(_llama(n_layer, d_model, n_head, n_kv_head, d_mlp, vocab_size, n_ctx, **kw), family="qwen2",
                   biases="qkv", tied_lm_head=tied)


def _deepseek(family, n_layer, d_model, n_head, d_mlp, vocab_size, mla, moe, **kw) -> Architecture:
    return Architecture(family, n_layer, d_model, n_head, d_mlp, vocab_size, n_ctx=163840, norm="rmsnorm", mlp="swiglu", biases="none", positions="rope",
                        tied_lm_head=False, mla=mla, moe=moe, **kw)


_HF = "https://huggingface.co/"
_QWEN2 = "Qwen2 technical report (arXiv 2407.10671), Table 1; " + _HF + "Qwen/{}"
_QWEN25 = _HF + "Qwen/{} (model card: 'Number of Parameters', '(Non-Embedding)')"
_SAFETENSORS = " (the card says {}; this exact figure is the released weights' count, the hub's safetensors total)"
_DEEPSEEK_ACTIVE = ("'activated' leaves out the token embedding table (a token reads one row of it), as "
                    "ours does; counting it gives {}")
# The served GPT-2 family first (SERVABLE), then every family the seeds' appendix tabulates. Each
# carries its published count and where it is published; tests/introspection/test_params.py checks both.
PRESETS: dict[str, Architecture] = {
    # GPT-2's cards round; the hub's own figure for gpt2 (137M) counts the attention masks stored
    # in its checkpoint as well, which are buffers, not parameters.
    "gpt2": _gpt(12, 768, 12, published="124M", source=_HF + "openai-community/gpt2 (model card)"),
    "gpt2-medium": _gpt(24, 1024, 16, published="355M", source=_HF + "openai-community/gpt2-medium (model card)"),
    "gpt2-large": _gpt(36, 1280, 20, published="774M", source=_HF + "openai-community/gpt2-large (model card)"),
    "gpt2-xl": _gpt(48, 1600, 25, published="1.5B", source=_HF + "openai-community/gpt2-xl (model card)"),
    "distilgpt2": _gpt(6, 768, 12, published="82M", source=_HF + "distilbert/distilgpt2 (model card)"),
    "tiny": _gpt(2, 64, 4, n_ctx=256),
    "gpt1": replace(_gpt(12, 768, 12, n_ctx=512, vocab_size=40478), family="openai-gpt", final_norm=False,
                    published="117M", source="Radford et al. 2018, 'Improving Language Understanding by "
                                             "Generative Pre-Training' (117M); " + _HF + "openai-community/openai-gpt"),
    "gpt3-175b": _gpt(96, 12288, 96, n_ctx=2048, published="175.0B",
                      source="Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1",
                      card_note="the paper's 175.0B is 0.4B over what its own Table 2.1 dimensions give"),
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096, published="6,738,415,616",
                         source=_HF + "meta-llama/Llama-2-7b-hf" + _SAFETENSORS.format("7B")),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096, published="13,015,864,320",
                          source=_HF + "meta-llama/Llama-2-13b-hf" + _SAFETENSORS.format("13B")),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096, published="68,976,648,192",
                          source=_HF + "meta-llama/Llama-2-70b-hf" + _SAFETENSORS.format("70B")),
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, published="8,030,261,248",
                         source=_HF + "meta-llama/Meta-Llama-3-8B" + _SAFETENSORS.format("8B")),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, published="70,553,706,496",
                          source=_HF + "meta-llama/Meta-Llama-3-70B" + _SAFETENSORS.format("70B")),
    "llama-3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, 131072, published="8,030,261,248",
                           source=_HF + "meta-llama/Llama-3.1-8B" + _SAFETENSORS.format("8B")),
    "llama-3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, 131072, published="70,553,706,496",
                            source=_HF + "meta-llama/Llama-3.1-70B" + _SAFETENSORS.format("70B")),
    "llama-3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, 131072, published="405,853,388,800",
                             source=_HF + "meta-llama/Llama-3.1-405B" + _SAFETENSORS.format("405B")),
    "qwen2-0.5b": _qwen(24, 896, 14, 2, 4864, True, vocab_size=151936, n_ctx=131072, published="0.49B",
                        source=_QWEN2.format("Qwen2-0.5B")),
    "qwen2-1.5b": _qwen(28, 1536, 12, 2, 8960, True, vocab_size=151936, n_ctx=131072, published="1.5B",
                        source=_QWEN2.format("Qwen2-1.5B")),
    "qwen2-7b": _qwen(28, 3584, 28, 4, 18944, False, n_ctx=131072, published="7B", source=_QWEN2.format("Qwen2-7B")),
    "qwen2-72b": _qwen(80, 8192, 64, 8, 29568, False, n_ctx=131072, published="72B",
                       source=_QWEN2.format("Qwen2-72B")),
    "qwen2.5-0.5b": _qwen(24, 896, 14, 2, 4864, True, vocab_size=151936, published="0.49B",
                          published_non_embedding="0.36B", source=_QWEN25.format("Qwen2.5-0.5B")),
    "qwen2.5-1.5b": _qwen(28, 1536, 12, 2, 8960, True, vocab_size=151936, published="1.54B",
                          published_non_embedding="1.31B", source=_QWEN25.format("Qwen2.5-1.5B")),
    "qwen2.5-3b": _qwen(36, 2048, 16, 2, 11008, True, vocab_size=151936, published="3.09B",
                        published_non_embedding="2.77B", source=_QWEN25.format("Qwen2.5-3B")),
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 18944, False, published="7.61B", published_non_embedding="6.53B",
                        source=_QWEN25.format("Qwen2.5-7B")),
    "qwen2.5-14b": _qwen(48, 5120, 40, 8, 13824, False, published="14.7B", published_non_embedding="13.1B",
                         source=_QWEN25.format("Qwen2.5-14B"),
                         card_note="the card's non-embedding 13.1B is 0.1B under what its own config.json gives"),
    "qwen2.5-32b": _qwen(64, 5120, 40, 8, 27648, False, published="32.5B", published_non_embedding="31.0B",
                         source=_QWEN25.format("Qwen2.5-32B"),
                         card_note="the card's 32.5B and 31.0B are 0.26B under what its own config.json gives"),
    "qwen2.5-72b": _qwen(80, 8192, 64, 8, 29568, False, published="72.7B", published_non_embedding="70.0B",
                         source=_QWEN25.format("Qwen2.5-72B"),
                         card_note="the card's non-embedding 70.0B is 0.2B under what its own config.json gives"),
    "deepseek-v2-lite": _deepseek("deepseek_v2", 27, 2048, 16, 10944, 102400,
                                  LatentAttention(0, 512, 128, 64, 128), MixtureOfExperts(64, 2, 6, 1408, 1),
                                  published="15.7B", published_active="2.4B",
                                  source=_HF + "deepseek-ai/DeepSeek-V2-Lite (model card: 'Total Params', "
                                         "'Activated Params')", card_note=_DEEPSEEK_ACTIVE.format("2.66B")),
    "deepseek-v2": _deepseek("deepseek_v2", 60, 5120, 128, 12288, 102400,
                             LatentAttention(1536, 512, 128, 64, 128), MixtureOfExperts(160, 2, 6, 1536, 1),
                             published="236B", published_active="21B",
                             source="DeepSeek-V2 technical report (arXiv 2405.04434); " + _HF + "deepseek-ai/DeepSeek-V2",
                             card_note=_DEEPSEEK_ACTIVE.format("21.4B")),
    "deepseek-v3": _deepseek("deepseek_v3", 61, 7168, 128, 18432, 129280,
                             LatentAttention(1536, 512, 128, 64, 128), MixtureOfExperts(256, 1, 8, 2048, 3),
                             published="671B", published_active="37B",
                             source="DeepSeek-V3 technical report (arXiv 2412.19437); " + _HF + "deepseek-ai/DeepSeek-V3"
                                    " (685B there: the main model's 671B and a 14B multi-token prediction module, "
                                    "not counted here)", card_note=_DEEPSEEK_ACTIVE.format("37.6B")),
}
SERVABLE = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2", "tiny")  # random:<name>


class ConfigError(ValueError):
    """A config.json this module cannot read."""


def from_hf_config(config: dict[str, Any]) -> Architecture:
    """A Hugging Face config.json (as a dict) of a family above -> its Architecture."""
    kind = config.get("model_type")
    get = config.get
    if kind not in ("gpt2", "openai-gpt", "llama", "qwen2", "deepseek_v2", "deepseek_v3"):
        raise ConfigError(f"model_type {kind!r} is not one of gpt2, openai-gpt, llama, qwen2, deepseek_v2, "
                          "deepseek_v3")
    try:
        if kind in ("gpt2", "openai-gpt"):
            d = config["n_embd"]
            return Architecture("gpt2" if kind == "gpt2" else kind, config["n_layer"], d, config["n_head"],
                                get("n_inner") or 4 * d, config["vocab_size"], config["n_positions"],
                                tied_lm_head=get("tie_word_embeddings", True), final_norm=kind == "gpt2")
        common = dict(n_layer=config["num_hidden_layers"], d_model=config["hidden_size"],
                      n_head=config["num_attention_heads"], d_mlp=config["intermediate_size"],
                      vocab_size=config["vocab_size"], n_ctx=get("max_position_embeddings", 0),
                      n_kv_head=get("num_key_value_heads") or 0, norm="rmsnorm", mlp="swiglu", positions="rope",
                      tied_lm_head=bool(get("tie_word_embeddings", False)))
        if kind == "llama":
            return Architecture("llama", biases="qkv" if get("attention_bias") else "none", **common)
        if kind == "qwen2":
            return Architecture("qwen2", biases="qkv", **common)
        mla = LatentAttention(get("q_lora_rank") or 0, config["kv_lora_rank"], config["qk_nope_head_dim"],
                              config["qk_rope_head_dim"], config["v_head_dim"])  # deepseek_v2, deepseek_v3
        moe = MixtureOfExperts(config["n_routed_experts"], get("n_shared_experts") or 0,
                               config["num_experts_per_tok"], config["moe_intermediate_size"],
                               get("first_k_dense_replace", 0)) if get("n_routed_experts") else None
        return Architecture(kind, biases="none", mla=mla, moe=moe, **{**common, "n_kv_head": 0})
    except KeyError as missing:
        raise ConfigError(f"config.json of model_type {kind!r} lacks {missing}") from None


def to_hf_config(arch: Architecture) -> dict[str, Any]:
    """The Hugging Face config.json keys of an Architecture (the inverse of from_hf_config)."""
    if arch.family in ("gpt2", "openai-gpt"):
        return dict(model_type=arch.family, n_layer=arch.n_layer, n_embd=arch.d_model, n_head=arch.n_head,
                    n_inner=arch.d_mlp, vocab_size=arch.vocab_size, n_positions=arch.n_ctx,
                    tie_word_embeddings=arch.tied_lm_head)
    config = dict(model_type=arch.family, num_hidden_layers=arch.n_layer, hidden_size=arch.d_model,
                  num_attention_heads=arch.n_head, num_key_value_heads=arch.kv_heads, intermediate_size=arch.d_mlp,
                  vocab_size=arch.vocab_size, max_position_embeddings=arch.n_ctx,
                  tie_word_embeddings=arch.tied_lm_head, attention_bias=arch.biases == "qkv")
    if arch.mla:
        config.update(q_lora_rank=arch.mla.q_rank or None, kv_lora_rank=arch.mla.kv_rank,
                      qk_nope_head_dim=arch.mla.d_nope, qk_rope_head_dim=arch.mla.d_rope,
                      v_head_dim=arch.mla.d_value, qk_head_dim=arch.mla.d_nope + arch.mla.d_rope)
    if arch.moe:
        config.update(n_routed_experts=arch.moe.n_routed, n_shared_experts=arch.moe.n_shared,
                      num_experts_per_tok=arch.moe.top_k, moe_intermediate_size=arch.moe.d_expert,
                      first_k_dense_replace=arch.moe.first_dense)
    return config


def published_summary(arch: Architecture) -> str:
    """The published figures in one line: "236B total, 21B active" and where they are published."""
    figures = [f"{arch.published} total"] if arch.published else []
    figures += [f"{arch.published_active} active"] if arch.published_active else []
    figures += [f"{arch.published_non_embedding} non-embedding"] if arch.published_non_embedding else []
    if not figures:
        return ""
    return ", ".join(figures) + f" ({arch.source})" + (f"; note: {arch.card_note}" if arch.card_note else "")


def as_dict(arch: Architecture) -> dict[str, Any]:
    return {key: value for key, value in asdict(arch).items()
            if not key.startswith("published") and key not in ("source", "card_note")}

