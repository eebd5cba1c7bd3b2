// Two CPU ops for generation, each one dispatcher call where torch needs a dozen small ones
// (see engine/native.py for how this file is built and loaded, and when it is not).
//
// gpt2serve::int8_linear: quantize.Int8Linear's forward. Each row is split into a 7-bit part
//   and its rounding error (scaled by 126), both go through fbgemm's int8 GEMM as rows of one
//   call, and the two results are recombined with the row's scale and the bias. The same
//   arithmetic, in the same order, as the torch ops in quantize.py.
// gpt2serve::decode_attention: one new query per row against the keys of its own slot of the
//   KV cache, reading positions 0..position[b] only (torch's attention reads the whole padded
//   span and masks it). The new key and value are written into the cache first.
//
// The loops are compiled three times (AVX-512, AVX2 + FMA, baseline x86-64) and the CPU picks
// one at load; fma and nearbyint are exactly rounded, so every version gives the same numbers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

constexpr float kSteps = 63.f;              // |x| <= 1 in 1/63 steps (quantize.ACTIVATION_STEPS)
constexpr float kErrorScale = 2 * kSteps;   // the rounding error, |e| <= 1/2 step, scaled to |x| <= 63
constexpr int64_t kZeroPoint = 64;          // quantize.ZERO_POINT
constexpr int64_t kLanes = 16;              // independent partial sums: vectorizable without reordering

// (N, K) rows -> row_max (N,), kept (N, K) = round(x * 63 / max), error (N, K) = what that lost * 126.
CLONES void split_rows(const float* in, int64_t N, int64_t K, float* row_max, float* error, float* kept) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * K;
    float m = 0.f;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, std::abs(x[k]));
    m = std::max(m, 1e-30f);  // a zero row divides by a tiny number, not by 0
    row_max[n] = m;
    const float to_steps = kSteps / m;
    float* e = error + n * K;
    float* q = kept + n * K;
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[k] * to_steps;
      const float rounded = std::nearbyint(v);  // half to even, as torch.round
      q[k] = rounded;
      e[k] = (v - rounded) * kErrorScale;
    }
  }
}

// One row's outputs [j0, j1): (kept + error / 126) * scale + bias.
CLONES void combine_row(const float* from_error, const float* from_kept, const float* bias, float scale,
                        int64_t j0, int64_t j1, float* out) {
  for (int64_t j = j0; j < j1; ++j) {
    const float v = std::fma(from_error[j], 1.f / kErrorScale, from_kept[j]) * scale;
    out[j] = bias ? v + bias[j] : v;
  }
}

at::Tensor int8_linear(const at::Tensor& x, const c10::intrusive_ptr<LinearPackedParamsBase>& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "int8_linear: fp32 CPU input");
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // (N, K)
  const int64_t N = rows.size(0);
  at::Tensor both = at::empty({2 * N, K}, rows.options());  // (2N, K): the error's rows, then the kept ones
  std::vector<float> row_max(N);
  float* error = both.mutable_data_ptr<float>();
  split_rows(rows.const_data_ptr<float>(), N, K, row_max.data(), error, error + N * K);
  // Scale 1: the kernel takes each value as the integer it is (plus the zero point).
  const at::Tensor product = packed->apply_with_input_q_dq_qweight_dq_output_fp32(both, 1.0, kZeroPoint);  // (2N, O)
  const int64_t O = product.size(1);
  at::Tensor y = at::empty({N, O}, rows.options());  // (N, O)
  const float* p = product.const_data_ptr<float>();
  const float* b = nullptr;
  at::Tensor bias_values;
  if (bias.has_value()) {
    bias_values = bias->contiguous();
    TORCH_CHECK(bias_values.scalar_type() == at::kFloat && bias_values.numel() == O, "int8_linear: bias (O,) fp32");
    b = bias_values.const_data_ptr<float>();
  }
  float* out = y.mutable_data_ptr<float>();
  at::parallel_for(0, N * O, 1 << 15, [&](int64_t begin, int64_t end) {  // the LM head's rows are worth two threads
    for (int64_t i = begin; i < end;) {
      const int64_t n = i / O, j0 = i % O, j1 = std::min(O, j0 + (end - i));
      combine_row(p + n * O, p + (N + n) * O, b, row_max[n] / kSteps, j0, j1, out + n * O);
      i += j1 - j0;
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

// One (row, head): q (hs,) against keys/values (n, hs) with stride `step` between positions.
CLONES void attend_one(const float* q, const float* keys, const float* values, int64_t n, int64_t hs,
                       int64_t step, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* k = keys + j * step;
    float lanes[kLanes] = {};
    int64_t d = 0;
    for (; d + kLanes <= hs; d += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::fma(q[d + l], k[d + l], lanes[l]);
    float dot = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) dot += lanes[l];
    for (; d < hs; ++d) dot = std::fma(q[d], k[d], dot);
    scores[j] = dot * scale;
    top = std::max(top, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  for (int64_t d = 0; d < hs; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = scores[j] / total;
    const float* v = values + j * step;
    for (int64_t d = 0; d < hs; ++d) out[d] = std::fma(w, v[d], out[d]);
  }
}

// q, k_new, v_new (B, nh, 1, hs); keys, values (S, nh, L, hs), this layer's cache (S >= B slots);
// positions (B,) int64 -> (B, nh, 1, hs), laid out as (B, 1, nh, hs) so that putting the heads
// side by side again is a view.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "decode_attention: q (B, nh, 1, hs) fp32 on the CPU");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "decode_attention: contiguous fp32 keys and values (S, nh, L, hs)");
  const int64_t B = q.size(0), H = q.size(1), hs = q.size(3), L = keys.size(2);
  TORCH_CHECK(keys.size(0) >= B && keys.size(1) == H && keys.size(3) == hs, "decode_attention: cache shape");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t* at_pos = pos.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(at_pos[b] >= 0 && at_pos[b] < L, "decode_attention: position ", at_pos[b], " outside the cache");
  // (B, nh, hs) each, contiguous, for plain indexing
  const at::Tensor qc = q.reshape({B, H, hs}).contiguous();
  const at::Tensor kc = k_new.reshape({B, H, hs}).contiguous();
  const at::Tensor vc = v_new.reshape({B, H, hs}).contiguous();
  float* key_cache = keys.mutable_data_ptr<float>();
  float* value_cache = values.mutable_data_ptr<float>();
  const int64_t slot_step = H * L * hs, head_step = L * hs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t offset = b * slot_step + h * head_step + at_pos[b] * hs;
      std::copy_n(kc.const_data_ptr<float>() + (b * H + h) * hs, hs, key_cache + offset);
      std::copy_n(vc.const_data_ptr<float>() + (b * H + h) * hs, hs, value_cache + offset);
    }
  at::Tensor y = at::empty({B, 1, H, hs}, q.options());  // (B, 1, nh, hs)
  float* out = y.mutable_data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {  // one row's heads stay on one thread
    std::vector<float> scores(L);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H, base = b * slot_step + h * head_step;
      attend_one(qc.const_data_ptr<float>() + i * hs, key_cache + base, value_cache + base, at_pos[b] + 1, hs, hs,
                 scale, scores.data(), out + i * hs);
    }
  });
  return y.transpose(1, 2);  // (B, nh, 1, hs)
}

}  // namespace

TORCH_LIBRARY(gpt2serve, m) {
  m.def("int8_linear(Tensor x, __torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor? bias)"
        " -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) keys, Tensor(b!) values, Tensor positions)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2serve, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("decode_attention", decode_attention);
}
