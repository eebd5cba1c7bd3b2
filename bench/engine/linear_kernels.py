"""Which CPU kernel for a decode step's matrices: milliseconds per call of each candidate, for
GPT-2 small's shapes at 1-16 rows (issue 24: "measure before choosing").

    .venv/bin/python bench/engine/linear_kernels.py [--threads N] [--repeat 20]

Candidates, each y (N, out) = x (N, in) @ W.T with W (out, in):
- fp32 F.linear (MKL), and fp32 computed as (W @ x.T).T (the transposed GEMM);
- bf16 and fp16 weights and activations (F.linear);
- int8 weight-only, fp32 activations (aten._weight_int8pack_mm, gpt-fast's CPU kernel);
- int8 dynamic (fbgemm quantized::linear_dynamic: per-channel int8 weights, activations
  quantized per call, int32 accumulation) - note its activation scale is per tensor, so a row's
  result depends on the other rows of the batch;
- fp16 weight-only (fbgemm quantized::linear_dynamic_fp16: fp16 weights packed, converted in
  registers, fp32 activations and accumulation; rows independent).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = {"lm_head 50257x768": (50257, 768), "qkv 2304x768": (2304, 768), "mlp fc 3072x768": (3072, 768),
          "mlp proj 768x3072": (768, 3072)}
ROWS = (1, 2, 4, 8, 16)


def per_call_ms(fn, repeat: int) -> float:
    with torch.inference_mode():
        fn()
        fn()
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1000  # median


def candidates(weight: torch.Tensor):
    out_features = weight.shape[0]
    scales = weight.abs().amax(dim=1) / 127
    int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in 2.13, still there
        qweight = torch.quantize_per_channel(weight, scales.double(), torch.zeros(out_features, dtype=torch.long), 0,
                                             torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
        packed_fp16 = torch.ops.quantized.linear_prepack_fp16(weight, None)
    bf16, fp16 = weight.bfloat16(), weight.half()
    return {
        "fp32": lambda x: F.linear(x, weight),
        "fp32 W@x.T": lambda x: (weight @ x.T).T,
        "bf16": lambda x: F.linear(x.bfloat16(), bf16),
        "fp16": lambda x: F.linear(x.half(), fp16),
        "int8 weight-only": lambda x: torch.ops.aten._weight_int8pack_mm(x, int8, scales),
        "int8 dynamic": lambda x: torch.ops.quantized.linear_dynamic(x, packed),
        "fp16 weight-only (fbgemm)": lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed_fp16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {torch.backends.cpu.get_cpu_capability()}")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * 0.02
        kernels = candidates(weight)
        print(f"\n{name}: ms per call (median of {args.repeat})")
        print("| rows | " + " | ".join(kernels) + " |")
        print("|---" * (len(kernels) + 1) + "|")
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            cells = [f"{per_call_ms(lambda k=k: k(x), args.repeat):.2f}" for k in kernels.values()]
            print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
