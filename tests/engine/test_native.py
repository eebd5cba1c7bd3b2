"""engine.native: the compiled int8 Linear and decode attention give what the torch ops they
replace give, are really the ones a model runs where a compiler exists, are built once per
machine, and leave a working (torch ops) server where nothing can be compiled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from gpt2serve.engine import native
from gpt2serve.engine import quantize as quantize_module
from gpt2serve.engine.loading import build_random_model
from gpt2serve.engine.quantize import Int8Linear, _int8_per_channel, quantize


def test_the_ops_are_built_where_a_compiler_exists():
    assert shutil.which(os.environ.get("CXX") or "c++"), "this suite's machine has a C++ compiler"
    assert native.available()
    assert torch.ops.gpt2serve.int8_kernel() in ("avx512-vnni", "avx2", "portable")
    model = quantize(build_random_model("tiny", 0), "int8")
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.native for m in linears)


@pytest.fixture(params=["avx512-vnni", "avx2", "portable"])
def kernel(request):
    """Each kernel this CPU runs (a CPU without AVX-512 VNNI skips that one: it cannot run it)."""
    widest = torch.ops.gpt2serve.int8_kernel() if native.available() else None
    try:
        torch.ops.gpt2serve.use_int8_kernel(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU does not run the {request.param} kernel")
    yield request.param
    torch.ops.gpt2serve.use_int8_kernel(widest)


@pytest.mark.parametrize("shape", [(3072, 768), (768, 3072), (50, 64), (37, 13)])  # also partial blocks
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_linear_gives_what_its_torch_ops_give(shape, rows, with_bias, kernel):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=generator) * 0.02
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    linear = Int8Linear(*_int8_per_channel(weight), bias)
    with mock.patch.object(quantize_module.native, "available", lambda: False):
        fbgemm = Int8Linear(*_int8_per_channel(weight), bias)  # torch's ops around fbgemm's GEMM
    assert linear.native and not fbgemm.native
    x = torch.randn(2, rows, in_features, generator=generator)  # (2, rows, in): leading dims are kept
    x[0, 0] = 0.0  # a zero row: zeros (plus the bias), not NaN
    x[1, -1, 5] = 40.0  # an outlier feature
    with torch.inference_mode():
        fused = linear(x)
        eager = fbgemm(x)
    assert fused.shape == (2, rows, out_features)
    assert torch.isfinite(fused).all()
    # The same integers (exact), dequantized the same way; torch's vectorized loops may order the
    # last multiply-adds differently (an ulp or so).
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    alone = linear(x[1, -1:])  # (1, out): a row's numbers do not depend on its batchmates
    assert torch.equal(alone[0], fused[1, -1])


def sdpa_reference(q, keys, values, positions):
    """torch's attention over each row's slot, masked past its position (as the eager decode does)."""
    B, span = q.shape[0], int(positions.max()) + 1
    mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]  # (B, 1, 1, span)
    return F.scaled_dot_product_attention(q, keys[:B, :, :span], values[:B, :, :span], attn_mask=mask)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the cache beside int8 weights
def test_decode_attention_writes_the_new_key_and_attends_to_each_rows_own_positions(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    slots, heads, length, head_size = 16, 12, 128, 64
    keys = torch.randn(slots, heads, length, head_size, generator=generator).to(dtype)
    values = torch.randn(slots, heads, length, head_size, generator=generator).to(dtype)
    q, k, v = (torch.randn(rows, heads, 1, head_size, generator=generator) for _ in range(3))
    positions = torch.randint(0, length, (rows,), generator=generator)
    positions[0] = 0  # a first token attends to itself alone
    expected_keys, expected_values = keys.clone(), values.clone()
    for b in range(rows):
        expected_keys[b, :, positions[b]] = k[b, :, 0].to(dtype)  # rounded as torch rounds to fp16
        expected_values[b, :, positions[b]] = v[b, :, 0].to(dtype)
    with torch.inference_mode():
        y = torch.ops.gpt2serve.decode_attention(q, k, v, keys, values, positions)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert y.shape == (rows, heads, 1, head_size) and y.dtype == torch.float32
    expected = sdpa_reference(q, expected_keys.float(), expected_values.float(), positions)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # What lies past a row's position is never read: changing it changes nothing.
    keys[:, :, positions.max() + 1:] = float("nan")
    with torch.inference_mode():
        again = torch.ops.gpt2serve.decode_attention(q, k, v, keys, values, positions)
    assert torch.equal(again, y)


def test_decode_attention_refuses_a_position_outside_the_cache():
    keys = values = torch.zeros(2, 2, 8, 4)
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.gpt2serve.decode_attention(q, q, q, keys, values, torch.tensor([8]))


GREEDY = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from gpt2serve.engine import native
from gpt2serve.engine import quantize as quantize_module
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.engine.sampling import SamplingParams
generator = Generator(Engine(load_model("random:tiny", "cpu", "float32", quantize="int8")), slots=4)
prompts = [[5, 6, 7], [9] * 20, [1, 2]]
generator.prefill([NewSequence(i, p, SamplingParams(temperature=0), 0) for i, p in enumerate(prompts)])
tokens = [[] for _ in prompts]
for _ in range(40):
    for seq_id, token in generator.decode().tokens.items():
        tokens[seq_id].append(token.token_id)
print(json.dumps({"native": native.available(), "tokens": tokens}))
"""


def greedy_in_a_process(cache_dir, **env) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", GREEDY], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache_dir), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_built_once_per_machine_and_torch_ops_where_nothing_compiles(tmp_path):
    built, log = greedy_in_a_process(tmp_path / "cache")
    assert built["native"] and "compiling gpt2serve's CPU ops" in log
    assert len(list((tmp_path / "cache" / "gpt2serve").glob("native_ops-*.so"))) == 1
    again, log = greedy_in_a_process(tmp_path / "cache")
    assert again["native"] and "compiling" not in log  # the cached library, no compiler run
    # No compiler and nothing cached: a warning, and the same greedy tokens from torch's ops.
    fallback, log = greedy_in_a_process(tmp_path / "empty", CXX=str(tmp_path / "no-such-compiler"))
    assert not fallback["native"] and "compiled CPU ops are unavailable" in log
    assert fallback["tokens"] == built["tokens"] == again["tokens"]
    assert [len(t) for t in built["tokens"]] == [40, 40, 40]


def test_a_new_compiler_or_torch_builds_again_and_each_build_records_what_made_it(tmp_path, monkeypatch):
    """A library compiled against another torch's headers, or by another compiler, can crash
    rather than fail: either change keys a new build. (compile_ops stands in for the compiler
    here; the test above runs the real one.)"""
    built = []
    monkeypatch.setattr(native, "compile_ops", lambda output, flags=native.FLAGS, name=None: (
        built.append(output), output.write_bytes(b"")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = native._build()
    assert native._build() == first and len(built) == 1  # cached: no second build
    record = json.loads(first.with_suffix(".json").read_text())
    real = subprocess.run([native.compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert record["compiler_version"] == real and record["torch"] == torch.__version__

    wrapper = tmp_path / "c++-next"  # the same compiler, reporting a newer version
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "c++ (Debian 99.1.0) 99.1.0"; exit 0; }}\n'
                       f'exec {shutil.which("c++")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    second = native._build()
    assert second != first and len(built) == 2
    assert json.loads(second.with_suffix(".json").read_text())["compiler_version"] == "c++ (Debian 99.1.0) 99.1.0"

    monkeypatch.delenv("CXX")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    third = native._build()
    assert third not in (first, second) and len(built) == 3
    assert json.loads(third.with_suffix(".json").read_text())["torch"] == "9.9.9"
