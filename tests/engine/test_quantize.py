"""--quantize int8 / fp16: accuracy against fp32 bounded, rows independent of their batchmates,
and clear refusals where it cannot run.

The checkpoint is random:gpt2 with ln_f's gain scaled by 30, so its logits spread (std about 16)
instead of sitting near 0; with random weights the best two tokens are still close (the top of
50257 draws), which is what makes top-1 agreement a strict measure here.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
import time

import pytest
import torch

from support.servers import launch_server, mapped_files, metric_value, wait_for

from gpt2serve.engine.convert import to_transformers
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.loading import build_random_model, check_quantize, load_model
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.engine.quantize import Fp16Linear, Int8Linear, quantize
from gpt2serve.engine.sampling import SamplingParams
from gpt2serve.errors import ModelLoadError
from gpt2serve_client import Client

LOGIT_GAIN = 30.0


@pytest.fixture(scope="module")
def reference():
    model = build_random_model("gpt2", 0)
    with torch.no_grad():
        model.ln_f.weight.mul_(LOGIT_GAIN)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (8, 24), generator=generator)  # 8 prompts of 24 tokens: 192 positions
    return model, ids, logits(model, ids)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    with torch.inference_mode():
        hidden = model.hidden_states(ids, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.bool))
        return model.lm_head(model.ln_f(hidden)).reshape(B * T, -1)  # (B*T, V)


def weight_rounded(model):
    """fp32 model with every weight matrix rounded as int8 per output channel: the error of
    weight-only int8 alone (what gpt-fast's kernel would give), the bar for ours."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                scale = module.weight.abs().amax(dim=1, keepdim=True) / 127
                module.weight.copy_(torch.round(module.weight / scale) * scale)
    return model


def errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(rms error / logit std, worst error / logit std, top-1 agreement), averaged over positions."""
    spread = ref.std(dim=1)
    rms = ((ours - ref).pow(2).mean(dim=1).sqrt() / spread).mean().item()
    worst = ((ours - ref).abs().amax(dim=1) / spread).max().item()
    agree = (ours.argmax(dim=1) == ref.argmax(dim=1)).float().mean().item()
    return rms, worst, agree


def test_int8_is_as_accurate_as_weight_only_int8(reference):
    model, ids, ref = reference
    assert ref.std(dim=1).mean() > 10  # the checkpoint's logits are spread out, not flat
    rms, worst, agree = errors(logits(quantize(copy.deepcopy(model), "int8"), ids), ref)
    bar_rms, _, bar_agree = errors(logits(weight_rounded(model), ids), ref)
    print(f"int8: rms {rms:.4f} worst {worst:.4f} top-1 {agree:.3f}; weight rounding alone: rms {bar_rms:.4f} "
          f"top-1 {bar_agree:.3f}")
    # Measured: rms 0.024, worst 0.13, top-1 0.93; weight rounding alone rms 0.025, top-1 0.92.
    # One activation part instead of two gave rms 0.057 and top-1 0.82, which this refuses.
    assert rms <= 1.2 * bar_rms
    assert rms < 0.04 and worst < 0.25
    assert agree >= 0.85 and agree >= bar_agree - 0.05


def test_fp16_is_within_fp16_rounding(reference):
    model, ids, ref = reference
    rms, worst, agree = errors(logits(quantize(copy.deepcopy(model), "fp16"), ids), ref)
    print(f"fp16: rms {rms:.5f} worst {worst:.5f} top-1 {agree:.3f}")
    assert rms < 0.002 and worst < 0.02 and agree >= 0.98  # measured: 0.0006, 0.0034, 1.0


@pytest.mark.parametrize("mode", ["int8", "fp16"])
def test_a_row_gets_the_same_numbers_whatever_shares_its_batch(mode):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 96) * 0.02, torch.randn(300) * 0.01
    linear = Int8Linear(*_per_channel(weight), bias) if mode == "int8" else Fp16Linear(weight, bias)
    rows = torch.randn(16, 96)
    rows[3] *= 100  # a batchmate with a much larger range must not change the others' rounding
    with torch.inference_mode():
        together = linear(rows)
        alone = torch.cat([linear(rows[i:i + 1]) for i in range(16)])
    if mode == "int8":  # fixed activation steps and exact int32 sums: bit for bit
        assert torch.equal(together, alone)
    else:  # fp32 sums in a batch-size-dependent order, like fp32's own GEMM (which differs by ~1e-5 too)
        assert torch.allclose(together, alone, rtol=1e-4, atol=1e-4)
    exact = rows @ weight.T + bias
    assert ((together - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.03


def _per_channel(weight):
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


def test_quantized_generation_does_not_depend_on_batchmates():
    """A seeded sampled sequence decodes the same tokens alone and beside others (int8)."""
    loaded = load_model("random:tiny", "cpu", "float32", quantize="int8")
    engine = Engine(loaded)
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def run(batchmates: int) -> list[int]:
        generator = Generator(engine, slots=8)
        sequences = [NewSequence(0, [464, 3139, 286, 4881, 318], params, 7)]
        sequences += [NewSequence(i, [50, 60 + i] * (i + 1), params, 100 + i) for i in range(1, batchmates + 1)]
        tokens = [generator.prefill(sequences).tokens[0].token_id]
        tokens += [generator.decode().tokens[0].token_id for _ in range(12)]
        return tokens

    assert run(0) == run(5)


def test_quantized_model_keeps_its_parameter_count_and_shrinks():
    fp32 = load_model("random:tiny", "cpu", "float32")
    int8 = load_model("random:tiny", "cpu", "float32", quantize="int8")
    assert int8.parameters == fp32.parameters == parameter_breakdown(fp32.model)
    assert int8.quantize == "int8"
    matrices = {name for name, param in int8.model.named_parameters() if param.dim() == 2}
    assert matrices == {"wpe.weight"}  # every other matrix is int8 now, positions stay fp32


def test_quantize_refuses_what_it_cannot_run():
    with pytest.raises(ModelLoadError, match="CPUs only"):
        check_quantize("int8", torch.device("cuda"), torch.float16)
    with pytest.raises(ModelLoadError, match="float32"):
        check_quantize("int8", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ModelLoadError, match="expected one of"):
        check_quantize("int4", torch.device("cpu"), torch.float32)
    check_quantize("none", torch.device("cuda"), torch.float16)  # nothing asked: nothing refused
    with pytest.raises(ModelLoadError, match="bfloat16"):
        load_model("random:tiny", "cpu", "bfloat16", quantize="fp16")


def test_quantized_checkpoint_loads_from_a_directory(tmp_path):
    """The real loading path: a checkpoint saved here, loaded with --quantize int8."""
    model = build_random_model("tiny", 5)
    to_transformers(model).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "cpu", "float32", quantize="int8")
    assert isinstance(loaded.model.lm_head, Int8Linear)
    ids = torch.tensor([[464, 3139, 286, 4881, 318]])
    rms, _, agree = errors(logits(loaded.model, ids), logits(model, ids))
    assert rms < 0.05 and agree == 1.0



@pytest.mark.parametrize("mode", ["none", "int8", "fp16"])
def test_a_loaded_checkpoint_leaves_nothing_of_its_file_mapped(tmp_path, mode):
    """The served model owns its memory: the safetensors file is unmapped once loading is done,
    so none of its pages stay resident beside the weights (fp32's, or int8's and fp16's made
    from them). A tensor left a view of the file once kept all of it mapped."""
    to_transformers(build_random_model("tiny", 5)).save_pretrained(tmp_path)
    checkpoint = str((tmp_path / "model.safetensors").resolve())
    loaded = load_model(str(tmp_path), "cpu", "float32", quantize=mode)
    gc.collect()
    assert checkpoint not in mapped_files(os.getpid())
    ids = torch.tensor([[464, 3139, 286]])
    assert torch.isfinite(logits(loaded.model, ids)).all()  # and the weights are all there


def resident_mib(pid: int) -> float:
    """VmRSS of a process and of every process below it, MiB."""
    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            with open(f"/proc/{current}/task/{current}/children") as children:
                pids += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # a process that just ended holds nothing
    return total / 1024


@pytest.mark.slow
def test_served_int8_holds_sixteen_streams_within_800_mib(tmp_path):
    """GPT-2 small's shape, from a checkpoint directory, with --quantize int8 and default flags
    otherwise: 16 concurrent streams of 16 + 64 tokens. Every process of the server together stays
    at or under 800 MiB resident at its peak while the streams run (sampled every 50 ms): the fp32
    weights it loaded first are given back, the checkpoint's file is unmapped, the cache holds
    what the streams hold. It says what it serves."""
    checkpoint = tmp_path / "ckpt"
    to_transformers(build_random_model("gpt2", 0)).save_pretrained(checkpoint)
    server = launch_server(tmp_path, "--model", str(checkpoint), "--quantize", "int8")
    try:
        with Client(server.grpc_target, timeout=600) as client:  # a busy machine is slow, not wrong
            info = client.model_info()
            assert info.quantize == "int8" and info.dtype == "float32"
            assert info.parameters.total == 124439808  # GPT-2 small, counted before packing
            prompts = [[(300 + 17 * i + 5 * j) % 50257 for j in range(16)] for i in range(16)]
            done, readings = [], [resident_mib(server.proc.pid)]

            def stream(prompt):
                done.append(client.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True))

            threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads) and len(readings) < 12000:  # 10 min at most
                readings.append(resident_mib(server.proc.pid))
                time.sleep(0.05)
            for thread in threads:
                thread.join(timeout=300)
            assert [d.usage.completion_tokens for d in done] == [64] * 16
        wait_for(lambda: metric_value(server.http_url, "gpt2serve_running_sequences") == 0, timeout=30)
        settled = resident_mib(server.proc.pid)
        print(f"server RSS: {readings[0]:.0f} MiB before, peak {max(readings):.0f} MiB over {len(readings)} "
              f"readings during 16 streams, {settled:.0f} MiB after")
        assert len(readings) > 10  # the streams ran long enough to be watched
        assert max(readings) <= 800
        assert not [f for f in mapped_files(server.proc.pid) if f.startswith(str(checkpoint))]
    finally:
        server.stop()


@pytest.mark.parametrize("mode, expected", [("none", torch.float32), ("int8", torch.float16), ("fp16", torch.float16)])
def test_quantized_models_keep_their_kv_cache_in_fp16(mode, expected):
    """Beside quantized weights the cache is fp16 (half the bytes a decode step reads and the
    cache holds, as llama.cpp keeps it); an fp32 model's stays fp32, exact against transformers."""
    generator = Generator(Engine(load_model("random:tiny", "cpu", "float32", quantize=mode)), slots=2)
    generator.prefill([NewSequence(0, [1, 2, 3], SamplingParams(temperature=0), 0)])
    generator.decode()
    assert generator.cache.keys.dtype == generator.cache.values.dtype == expected
