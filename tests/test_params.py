"""`gpt2serve params`: the analytic count against the real tensors, and the printed table."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from gpt2serve.engine.gpt2 import GPT2
from gpt2serve.engine.loading import ARCHITECTURES
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.introspection.params import PRESETS, SERVABLE, count_parameters

FIELDS = ("token_embedding", "position_embedding", "attention_qkv", "attention_output", "mlp", "layer_norm",
          "lm_head", "total")


@pytest.mark.parametrize("arch", SERVABLE)
def test_the_analytic_count_equals_the_counted_tensors_of_every_random_size(arch):
    with torch.device("meta"):  # real shapes, no weights
        model = GPT2(ARCHITECTURES[arch])
    counted = asdict(parameter_breakdown(model))
    analytic = asdict(count_parameters(**PRESETS[arch]))
    assert {f: analytic[f] for f in FIELDS} == {f: counted[f] for f in FIELDS}
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert count_parameters(**PRESETS[arch]).block == block


def test_gpt2_and_gpt3_totals():
    assert count_parameters(**PRESETS["gpt2"]).total == 124_439_808
    gpt3 = count_parameters(**PRESETS["gpt3-175b"])
    assert gpt3.total == 174_604_259_328 and 174e9 < gpt3.total < 176e9
    untied = count_parameters(**PRESETS["gpt2"], tied_lm_head=False)
    assert untied.lm_head == 50257 * 768 and untied.total == 124_439_808 + 50257 * 768


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2serve.cli", "params", *argv], capture_output=True, text=True,
                          timeout=60)


def test_the_command_prints_the_table_with_the_exact_totals():
    out = run("gpt3-175b")
    assert out.returncode == 0, out.stderr
    assert "96 layers, d_model 12288" in out.stdout and "174,604,259,328" in out.stdout
    gpt2 = run()
    assert "124,439,808" in gpt2.stdout and "38,597,376" in gpt2.stdout and "(tied: shares wte)" in gpt2.stdout
    custom = run("--n-layer", "4", "--d-model", "256", "--n-head", "8", "--vocab", "1000", "--n-ctx", "128")
    want = count_parameters(n_layer=4, d_model=256, d_mlp=1024, n_ctx=128, vocab_size=1000).total
    assert f"total: {want:,} parameters" in custom.stdout
    assert run("--n-head", "7").returncode == 2  # 768 is no multiple of 7
