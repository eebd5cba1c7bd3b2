"""Fuzz engine.native's ops with hypothesis: shapes, positions, dtypes and argument mistakes.

Run as a script by test_native_sanitized.py, with the library path as its argument, against a
build under AddressSanitizer (a read or write outside a buffer aborts the process with a
report). Each call is judged too: arguments the op's contract allows must give the reference's
answer, and any others must raise a RuntimeError, never return. Prints how many calls of each
kind it made, as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt2serve.engine.quantize import _int8_per_channel, pack_blocks

torch.ops.load_library(sys.argv[1])
counts = {"attention_ok": 0, "attention_refused": 0, "linear_ok": 0, "linear_refused": 0}
# derandomize: the same calls every run, so a failure here is this code's, and reproducible.
FUZZ = settings(max_examples=int(sys.argv[2]), deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def reference_attention(q, k, v, keys, values, positions):
    """What decode_attention writes and returns, in torch: (B, nh, 1, hs) and the new caches."""
    keys, values = keys.clone(), values.clone()
    out = torch.empty_like(q)
    for b, p in enumerate(positions.tolist()):
        keys[b, :, p], values[b, :, p] = k[b, :, 0].to(keys.dtype), v[b, :, 0].to(values.dtype)
        seen_k, seen_v = keys[b, :, :p + 1].float(), values[b, :, :p + 1].float()  # (nh, p+1, hs)
        weights = torch.softmax(q[b] @ seen_k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)  # (nh, 1, p+1)
        out[b] = weights @ seen_v
    return out, keys, values


@FUZZ
@given(B=st.integers(1, 4), H=st.integers(1, 3), hs=st.integers(1, 40), L=st.integers(1, 12),
       extra_slots=st.integers(-1, 2), half=st.booleans(), data=st.data(),
       mistake=st.sampled_from(["none", "none", "none", "positions_length", "position_value", "positions_float",
                                "positions_2d", "k_shape", "v_shape", "keys_3d", "keys_5d", "values_dtype",
                                "q_shape", "cache_heads", "cache_hs"]))
def fuzz_decode_attention(B, H, hs, L, extra_slots, half, data, mistake):
    dtype = torch.float16 if half else torch.float32
    S = max(B + extra_slots, 1)  # cache slots: fewer than B rows (a mistake) now and then
    q, k, v = (torch.randn(B, H, 1, hs) for _ in range(3))
    keys, values = (torch.randn(S, H, L, hs).to(dtype) for _ in range(2))
    positions = torch.tensor(data.draw(st.lists(st.integers(0, L - 1), min_size=B, max_size=B)))
    valid = S >= B
    if mistake == "positions_length":
        positions = torch.tensor(data.draw(st.lists(st.integers(0, L - 1), max_size=B + 2).filter(
            lambda p: len(p) != B)), dtype=torch.long)
    elif mistake == "position_value":
        positions[data.draw(st.integers(0, B - 1))] = data.draw(st.sampled_from([-1, L, L + 5, -(2 ** 40)]))
    elif mistake == "positions_float":
        positions = positions.float()
    elif mistake == "positions_2d":
        positions = positions[:, None]
    elif mistake == "k_shape":
        k = torch.randn(B, H, 1, hs + 1)
    elif mistake == "v_shape":
        v = torch.randn(B + 1, H, 1, hs)
    elif mistake == "keys_3d":
        keys = values = keys.reshape(S, H, L * hs)
    elif mistake == "keys_5d":
        keys = values = keys[:, :, :, None, :]
    elif mistake == "values_dtype":
        values = values.to(torch.float32 if half else torch.float16)
    elif mistake == "q_shape":
        q = torch.randn(B, H, 2, hs)
    elif mistake == "cache_heads":
        keys, values = (torch.randn(S, H + 1, L, hs).to(dtype) for _ in range(2))
    elif mistake == "cache_hs":
        keys, values = (torch.randn(S, H, L, hs + 3).to(dtype) for _ in range(2))
    valid = valid and mistake == "none"
    before_keys, before_values = keys.clone(), values.clone()
    try:
        y = torch.ops.gpt2serve.decode_attention(q, k, v, keys, values, positions)
    except RuntimeError:
        assert not valid, f"refused a valid call: B={B} H={H} hs={hs} L={L} S={S} {dtype}"
        counts["attention_refused"] += 1
        return
    assert valid, f"accepted {mistake} (B={B} H={H} hs={hs} L={L} S={S})"
    want, want_keys, want_values = reference_attention(q, k, v, before_keys, before_values, positions)
    tolerance = 1e-2 if half else 1e-4
    torch.testing.assert_close(y, want, atol=tolerance, rtol=tolerance)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    counts["attention_ok"] += 1


@FUZZ
@given(K=st.integers(1, 80), O=st.integers(1, 70), rows=st.lists(st.integers(1, 5), min_size=1, max_size=2),
       with_bias=st.booleans(),
       mistake=st.sampled_from(["none", "none", "none", "weight_short", "weight_long", "scales_length",
                                "offsets_length", "bias_length", "x_width", "x_double", "weight_dtype",
                                "offsets_dtype", "scalar_x"]))
def fuzz_int8_linear(K, O, rows, with_bias, mistake):
    weight = torch.randn(O, K) * 0.05
    int8, scales = _int8_per_channel(weight)
    blocks = pack_blocks(int8)
    offsets = (64 * int8.sum(dim=1, dtype=torch.int32)).to(torch.int32)
    bias = torch.randn(O) if with_bias else None
    x = torch.randn(*rows, K)
    if mistake == "weight_short":
        blocks = blocks[:-1]
    elif mistake == "weight_long":
        blocks = torch.cat([blocks, blocks[:64]])
    elif mistake == "scales_length":
        scales = scales[:-1] if O > 1 else torch.ones(2)
    elif mistake == "offsets_length":
        offsets = torch.cat([offsets, offsets])
    elif mistake == "bias_length":
        bias = torch.randn(O + 1)
    elif mistake == "x_width":
        x = torch.randn(*rows, K + 4)  # packed for K: four more inputs make one more group
    elif mistake == "x_double":
        x = x.double()
    elif mistake == "weight_dtype":
        blocks = blocks.to(torch.uint8)
    elif mistake == "offsets_dtype":
        offsets = offsets.long()
    elif mistake == "scalar_x":
        x = torch.tensor(1.0)
    try:
        y = torch.ops.gpt2serve.int8_linear(x, blocks, scales, offsets, bias)
    except RuntimeError:
        assert mistake != "none", f"refused a valid call: K={K} O={O} rows={rows}"
        counts["linear_refused"] += 1
        return
    assert mistake == "none", f"accepted {mistake} (K={K} O={O} rows={rows})"
    # The activations' two-part rounding errs by at most half a step of 1/(63 * 126) of the row's
    # largest value, per input: the bound below, twice over.
    want = x @ (int8.float() * scales[:, None]).T + (0 if bias is None else bias)
    bound = (int8.float().abs() * scales[:, None]).sum(dim=1) * x.abs().amax(dim=-1, keepdim=True) / (63 * 126)
    assert y.shape == want.shape and bool(((y - want).abs() <= bound + 1e-4).all())
    counts["linear_ok"] += 1


fuzz_decode_attention()
fuzz_int8_linear()
print(json.dumps(counts))
