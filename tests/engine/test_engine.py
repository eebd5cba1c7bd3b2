"""Engine and loading, in process: batching correctness, parameter counts, loading paths."""

from __future__ import annotations

import pytest
import torch
from support.reference import assert_matches_reference, transformers_random_model
from support.reference import as_result

from gpt2serve.engine.convert import from_transformers, to_transformers
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import plain_asks
from gpt2serve.engine.gpt2 import GPT2
from gpt2serve.engine.loading import ARCHITECTURES, build_random_model, load_model
from gpt2serve.engine.model_info import architecture, parameter_breakdown
from gpt2serve.errors import ModelLoadError

PROMPTS = [
    [464, 3139, 286, 4881, 318],  # "The capital of France is"
    [15496],
    [40, 588, 257, 3797, 290, 262, 1266, 286, 428, 318, 257, 1332, 6152],
    [50256, 0, 50255, 7, 7, 7],
]


@pytest.mark.parametrize("arch", ["tiny", "gpt2"])
def test_batched_answers_equal_each_prompt_alone(arch):
    loaded = load_model(f"random:{arch}", "cpu", "float32", seed=3)
    engine = Engine(loaded)
    out = engine.next_token(plain_asks(PROMPTS, [5, 1, 8, 3]))
    assert out.padded_len == max(len(p) for p in PROMPTS)
    for prompt, top, k in zip(PROMPTS, out.top, [5, 1, 8, 3]):
        assert_matches_reference(loaded.model, as_result(prompt, top), prompt, k)


def test_gpt2_parameter_breakdown_matches_the_real_count():
    model = build_random_model("gpt2", seed=0)
    counts = parameter_breakdown(model)
    assert counts.total == sum(p.numel() for p in model.parameters()) == 124_439_808
    assert counts.token_embedding == 38_597_376
    assert counts.position_embedding == 786_432
    assert counts.attention_qkv == 12 * (1_769_472 + 2_304)
    assert counts.attention_output == 12 * (589_824 + 768)
    assert counts.mlp == 12 * (2_359_296 + 3_072 + 2_359_296 + 768)
    assert counts.layer_norm == 12 * 3_072 + 1_536
    assert counts.lm_head == 0  # tied to wte
    arch = architecture(model.config)
    assert (arch.n_layer, arch.n_head, arch.d_model, arch.d_head, arch.d_mlp, arch.n_ctx, arch.vocab_size) == (
        12, 12, 768, 64, 3072, 1024, 50257)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_random_architecture_counts_what_transformers_counts(arch):
    """Our GPT2 has exactly the parameters of transformers' model of the same shape (meta tensors:
    no weights are made)."""
    from gpt2serve.engine.convert import config_to_transformers
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        ours = GPT2(ARCHITECTURES[arch])
        theirs = GPT2LMHeadModel(config_to_transformers(ARCHITECTURES[arch]))
    assert parameter_breakdown(ours).total == sum(p.numel() for p in theirs.parameters())


def test_untied_lm_head_is_counted_separately(tmp_path):
    hf = transformers_random_model(seed=0, tie_word_embeddings=False)
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    model = from_transformers(hf)
    assert model.lm_head.weight is not model.wte.weight
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    counts = parameter_breakdown(model)
    assert counts.lm_head == 50257 * 64
    assert counts.total == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    out = Engine(load_model_from(hf, tmp_path)).next_token(plain_asks([PROMPTS[0]], [4]))
    assert_matches_reference(hf, as_result(PROMPTS[0], out.top[0]), PROMPTS[0], 4)


def load_model_from(hf_model, path):
    hf_model.save_pretrained(path)
    return load_model(str(path), "cpu", "float32")


def test_random_weights_are_seeded():
    a, b, c = (build_random_model("tiny", seed=s) for s in (1, 1, 2))
    assert torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    assert a.lm_head.weight is a.wte.weight  # tied, as in every GPT-2 checkpoint


def test_loads_a_local_checkpoint_directory(tmp_path):
    """A checkpoint saved by transformers: names mapped, Conv1D weights transposed, same answers."""
    saved = transformers_random_model(seed=11)
    loaded = load_model_from(saved, tmp_path)
    assert loaded.weights == "pretrained"
    assert loaded.weights_source == str(tmp_path.resolve())
    assert torch.equal(loaded.model.wte.weight, saved.transformer.wte.weight)
    assert torch.equal(loaded.model.blocks[1].attn.qkv.weight, saved.transformer.h[1].attn.c_attn.weight.t())
    assert torch.equal(loaded.model.blocks[1].mlp.proj.weight, saved.transformer.h[1].mlp.c_proj.weight.t())
    out = Engine(loaded).next_token(plain_asks(PROMPTS, [4] * len(PROMPTS)))
    for prompt, top in zip(PROMPTS, out.top):
        assert_matches_reference(saved, as_result(prompt, top), prompt, 4)


def test_bfloat16_on_cpu_when_forced():
    loaded = load_model("random:tiny", "cpu", "bfloat16")
    assert loaded.model.wte.weight.dtype == torch.bfloat16
    out = Engine(loaded).next_token(plain_asks([PROMPTS[0]], [3]))
    assert len(out.top[0]) == 3 and all(isinstance(s.logprob, float) for s in out.top[0])


def test_auto_device_and_dtype_on_cpu():
    loaded = load_model("random:tiny")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert loaded.device.type == expected
    assert loaded.dtype == (torch.float32 if expected == "cpu" else loaded.dtype)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # An empty cache.


def test_unreachable_hub_falls_back_to_random_weights(offline_hub, caplog):
    loaded = load_model("distilgpt2", "cpu", "float32", random_fallback=True)
    assert loaded.weights == "random"
    assert loaded.model.config.n_layer == 6 and len(loaded.model.blocks) == 6
    assert "FALLING BACK TO RANDOM WEIGHTS" in caplog.text


def test_fallback_can_be_turned_off(offline_hub):
    with pytest.raises(ModelLoadError, match="unreachable"):
        load_model("distilgpt2", "cpu", "float32", random_fallback=False)


@pytest.mark.parametrize("spec, message", [
    ("./no-such-dir", "no such checkpoint directory"),
    ("random:gpt5", "unknown architecture"),
])
def test_bad_model_specs_fail_clearly(spec, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(spec, "cpu", "float32")


def test_non_gpt2_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), "cpu", "float32")


def same_weights(ours: GPT2, loaded: GPT2) -> bool:
    theirs = loaded.state_dict()
    return all(torch.equal(tensor, theirs[name]) for name, tensor in ours.state_dict().items())


def cached_hub_repo(tmp_path, monkeypatch, model: GPT2, safetensors: bool = True) -> None:
    """someone/tiny-gpt2 in a local Hugging Face cache (its layout: refs/main names the snapshot)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, commit = cache / "models--someone--tiny-gpt2", "0123456789abcdef0123456789abcdef01234567"
    snapshot, hf = repo / "snapshots" / commit, to_transformers(model)
    if safetensors:
        hf.save_pretrained(snapshot)
    else:  # transformers 5 writes safetensors only
        hf.config.save_pretrained(snapshot)
        torch.save(hf.state_dict(), snapshot / "pytorch_model.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_loads_offline_from_the_local_hub_cache(tmp_path, monkeypatch):
    """A hub id already in the local cache loads with no network, through huggingface_hub as for
    a download."""
    model = build_random_model("tiny", 3)
    cached_hub_repo(tmp_path, monkeypatch, model)
    loaded = load_model("someone/tiny-gpt2", "cpu", "float32", random_fallback=False)
    assert loaded.weights == "pretrained" and loaded.weights_source == "huggingface:someone/tiny-gpt2"
    assert same_weights(model, loaded.model)


def test_a_hub_id_with_pickle_weights_only_needs_allow_pickle(tmp_path, monkeypatch):
    model = build_random_model("tiny", 5)
    cached_hub_repo(tmp_path, monkeypatch, model, safetensors=False)
    with pytest.raises(ModelLoadError, match=r"^someone/tiny-gpt2: .*pickle.*--allow-pickle"):
        load_model("someone/tiny-gpt2", "cpu", "float32", random_fallback=False)
    loaded = load_model("someone/tiny-gpt2", "cpu", "float32", random_fallback=False, allow_pickle=True)
    assert same_weights(model, loaded.model)


def test_a_checkpoint_saved_without_the_transformer_prefix_loads(tmp_path):
    """The hub's own gpt2 names its tensors as GPT2Model does ("h.0.attn.c_attn.weight", no
    "transformer." and no lm_head) and keeps the old causal-mask buffers ("h.0.attn.bias")."""
    from safetensors.torch import save_file

    model = build_random_model("tiny", 4)
    hf = to_transformers(model)
    hf.config.save_pretrained(tmp_path)
    tensors = {name.removeprefix("transformer."): tensor.contiguous()
               for name, tensor in hf.state_dict().items() if name != "lm_head.weight"}
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 8, 8).tril()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path), "cpu", "float32")
    assert same_weights(model, loaded.model)
