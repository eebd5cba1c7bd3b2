"""`gpt2serve params`: the analytic count against real tensors (ours for the served sizes,
transformers' own modules for every family), against each preset's published figure, and the
printed table, JSON, --config and --shapes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
import transformers

from gpt2serve.engine.gpt2 import GPT2
from gpt2serve.engine.loading import ARCHITECTURES
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.introspection.architectures import PRESETS, SERVABLE, from_hf_config, to_hf_config
from gpt2serve.introspection.params import count

# ModelInfo's ParameterBreakdown field -> our line key
SERVED_FIELDS = {"token_embedding": "token_embedding", "position_embedding": "position_embedding",
                 "attention_qkv": "attention_qkv", "attention_output": "attention_output", "mlp": "mlp",
                 "layer_norm": "norms", "lm_head": "lm_head"}
HF_CONFIGS = {"gpt2": transformers.GPT2Config, "openai-gpt": transformers.OpenAIGPTConfig,
              "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config}


def transformers_count(config: transformers.PretrainedConfig) -> int:
    """Parameters of transformers' own implementation of `config`, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", SERVABLE)
def test_the_analytic_count_equals_the_counted_tensors_of_every_random_size(arch):
    with torch.device("meta"):  # real shapes, no weights
        model = GPT2(ARCHITECTURES[arch])
    counted = asdict(parameter_breakdown(model))
    analytic = count(PRESETS[arch])
    assert {f: analytic[key] for f, key in SERVED_FIELDS.items()} == {f: counted[f] for f in SERVED_FIELDS}
    assert analytic.total == counted["total"]
    assert analytic.block == sum(p.numel() for p in model.blocks[0].parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_counts_what_transformers_builds_from_its_config(name):
    arch = PRESETS[name]
    hf = HF_CONFIGS[arch.family](**to_hf_config(arch))
    assert count(arch).total == transformers_count(hf)
    # and the config transformers writes reads back as the same architecture (what --config does)
    assert from_hf_config(hf.to_dict()) == replace(arch, published="", published_active="", published_non_embedding="",
                                                   source="", card_note="")


def figure(text: str) -> tuple[float, float]:
    """A published figure -> (value, one unit of its last digit): "7.61B" -> (7.61e9, 1e7);
    "6,738,415,616" -> (exact, 0)."""
    if re.fullmatch(r"[\d,]+", text):
        return float(text.replace(",", "")), 0.0
    number, unit = re.fullmatch(r"([\d.]+)([MB])", text).groups()
    scale = {"M": 1e6, "B": 1e9}[unit]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * scale, scale / 10 ** decimals


@pytest.mark.parametrize("name", [name for name in PRESETS if PRESETS[name].published])
def test_every_preset_matches_its_published_count(name):
    """Exact figures to the parameter; rounded ones to within one unit of their last digit (cards
    round or cut: 7.616B is "7.61B"). Where a card disagrees with its own config (card_note, cited
    beside the preset), within 1%."""
    arch, b = PRESETS[name], count(PRESETS[name])
    assert arch.source
    for published, ours in ((arch.published, b.total), (arch.published_active, b.active),
                            (arch.published_non_embedding, b.non_embedding)):
        if not published:
            continue
        value, unit = figure(published)
        if unit == 0:
            assert ours == value, f"{name}: {ours:,} against the published {published}"
        else:
            allowed = max(unit, 0.01 * value) if arch.card_note else unit
            assert abs(ours - value) <= allowed, f"{name}: {ours:,} against the published {published}"


def test_the_seeds_figures_gpt2_and_gpt3():
    assert count(PRESETS["gpt2"]).total == 124_439_808
    gpt3 = count(PRESETS["gpt3-175b"])
    assert gpt3.total == 174_604_259_328 and 174e9 < gpt3.total < 176e9
    untied = count(replace(PRESETS["gpt2"], tied_lm_head=False))
    assert untied["lm_head"] == 50257 * 768 and untied.total == 124_439_808 + 50257 * 768


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2serve.cli", "params", *argv], capture_output=True, text=True,
                          timeout=60)


def test_the_command_prints_the_table_with_the_exact_totals():
    out = run("gpt3-175b")
    assert out.returncode == 0, out.stderr
    assert "96 layers, d_model 12288" in out.stdout and "174,604,259,328" in out.stdout
    gpt2 = run()
    assert "124,439,808" in gpt2.stdout and "38,597,376" in gpt2.stdout and "tied: shares the token embedding" in gpt2.stdout
    custom = run("--n-layer", "4", "--d-model", "256", "--n-head", "8", "--vocab", "1000", "--n-ctx", "128")
    want = count(replace(PRESETS["gpt2"], n_layer=4, d_model=256, n_head=8, d_mlp=1024, vocab_size=1000,
                         n_ctx=128)).total
    assert f"total: {want:,} parameters" in custom.stdout
    assert run("--n-head", "7").returncode == 2  # 768 is no multiple of 7


def line(table: str, component: str) -> str:
    return next(row for row in table.splitlines() if row.startswith(component))


def test_each_architecture_feature_has_its_own_line():
    llama = run("llama-3-8b").stdout
    assert "grouped-query attention: 8 key/value heads, each shared by 4 query heads" in line(llama, "attention K, V")
    assert "SwiGLU: gate, up and down" in line(llama, "MLP (32 blocks)")
    assert "RMSNorm: a gain" in line(llama, "norms")
    assert "untied" in line(llama, "lm_head") and f"{128256 * 4096:,}" in line(llama, "lm_head")
    assert "rotary" in line(llama, "position embedding")
    v3 = run("deepseek-v3").stdout
    assert "256 a block, 8 active per token" in line(v3, "MoE routed experts")
    assert "1 a block, every token" in line(v3, "MoE shared experts")
    assert "multi-head latent attention" in line(v3, "latent attention, down")
    assert "MLP (3 dense blocks)" in v3 and "MoE router (58 blocks)" in v3
    b = count(PRESETS["deepseek-v3"])
    assert f"{b.active:,}" in line(v3, "active per token") and f"{b.total:,}" in line(v3, "total")
    gpt2 = run("gpt2").stdout
    assert "LayerNorm: gain and shift" in line(gpt2, "norms") and "attention Q, K, V" in gpt2


@pytest.mark.parametrize("name", ["deepseek-v2", "qwen2.5-7b", "gpt1"])
def test_json_has_integer_totals_and_active_for_experts(name):
    out = run(name, "--json")
    assert out.returncode == 0, out.stderr
    data, b = json.loads(out.stdout), count(PRESETS[name])
    assert type(data["total"]) is int and data["total"] == b.total
    assert sum(line["parameters"] for line in data["lines"]) == b.total
    if PRESETS[name].moe:
        assert type(data["active"]) is int and data["active"] == b.active < b.total
    else:
        assert "active" not in data
    assert data["published"]["source"] == PRESETS[name].source


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(num_hidden_layers=3, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=688, vocab_size=1000, tie_word_embeddings=True),
    transformers.Qwen2Config(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=300, vocab_size=500),
    transformers.DeepseekV3Config(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, q_lora_rank=64,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=64, first_k_dense_replace=1, intermediate_size=512,
                                  vocab_size=700, n_group=1, topk_group=1),
    transformers.DeepseekV2Config(num_hidden_layers=3, hidden_size=128, num_attention_heads=4, q_lora_rank=None,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                  n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2,
                                  moe_intermediate_size=48, first_k_dense_replace=1, intermediate_size=256,
                                  vocab_size=600),
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64),
], ids=lambda c: c.model_type)
def test_a_hugging_face_config_json_is_counted_as_transformers_builds_it(config, tmp_path):
    config.save_pretrained(tmp_path)  # writes tmp_path/config.json as the hub holds it
    out = run("--config", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["total"] == transformers_count(config)
    assert run("--config", str(tmp_path / "config.json")).returncode == 0


def test_a_config_it_cannot_read_is_refused_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    out = run("--config", str(tmp_path))
    assert out.returncode == 2 and "model_type 'mamba' is not one of" in out.stdout
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    out = run("--config", str(tmp_path))
    assert out.returncode == 2 and "lacks 'num_hidden_layers'" in out.stdout
    out = run("--config", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "cannot read" in out.stdout


def test_shapes_prints_the_walk_through_for_a_preset():
    out = run("llama-3-8b", "--shapes", "--tokens", "5")
    assert out.returncode == 0, out.stderr
    assert re.search(r"K per head\s+\[1, 8, 5, 128\]", out.stdout)  # 8 key/value heads
    assert re.search(r"Q per head\s+\[1, 32, 5, 128\]", out.stdout)
    assert re.search(r"MLP hidden, SiLU\(gate\) × up\s+\[1, 5, 14336\]", out.stdout)
    assert re.search(r"logits\s+\[1, 128256\]", out.stdout)
    steps = json.loads(run("gpt2", "--shapes", "--json", "--batch", "2", "--tokens", "4").stdout)
    assert {"stage": "output", "name": "logits", "kind": "data", "shape": [2, 50257], "note": "one score per "
            "vocabulary entry"} in steps
