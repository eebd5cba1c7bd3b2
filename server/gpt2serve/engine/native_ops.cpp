// Two CPU ops for generation, each one dispatcher call where torch needs a dozen small ones
// (see engine/native.py for how this file is built and loaded, and when it is not).
//
// gpt2serve::int8_linear: quantize.Int8Linear's forward, on its own int8 kernel. Each row is
//   split into a 7-bit part and its rounding error (scaled by 126), both as bytes around the
//   zero point 64; both are multiplied by the int8 weight (exact int32 sums, as fbgemm's), and
//   dequantized and recombined as quantize.py's torch ops do, so the two paths agree to an ulp.
//   Why not fbgemm: about 20 us of fixed cost per call whatever its size (49 calls a step), and at
//   a few rows its second thread gained little; here threads split the output channels, each
//   reading its own part of the weight (GPT-2 small's 48 block Linears at one row, 2 cores:
//   7.3 -> 3.3 ms).
//   Kernels: AVX-512 VNNI, AVX2, portable C++; the widest the CPU runs is used.
// gpt2serve::decode_attention: one new query per row against the keys of its own slot of the
//   KV cache, reading positions 0..position[b] only (torch's attention reads the whole padded
//   span and masks it). The new key and value are written into the cache first.
//
// Loops without intrinsics are compiled three times (x86-64-v4, v3, baseline) and the CPU picks
// one at load; fma and nearbyint are exactly rounded, so every version gives the same numbers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

constexpr float kSteps = 63.f;              // |x| <= 1 in 1/63 steps (quantize.ACTIVATION_STEPS)
constexpr float kErrorScale = 2 * kSteps;   // the rounding error, |e| <= 1/2 step, scaled to |x| <= 63
constexpr int kZeroPoint = 64;              // quantize.ZERO_POINT: activations are bytes 1..127
constexpr int64_t kLanes = 16;              // independent partial sums: vectorizable without reordering
constexpr int64_t kBlock = 16;              // output channels per weight block (one AVX-512 vector)
constexpr int64_t kGroup = 4;               // inputs per byte group (one int32 lane of a dot product)
constexpr int64_t kRowsPerTile = 4;         // rows of x whose two parts share each weight load

// (N, K) rows -> row_max (N,) and bytes (N, 2, Kp), row n's two parts side by side: kept =
// round(x * 63 / max) and error = round((x * 63 / max - kept) * 126), each plus the zero point.
CLONES void split_rows(const float* in, int64_t N, int64_t K, int64_t Kp, float* row_max, uint8_t* bytes) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * K;
    float m = 0.f;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, std::abs(x[k]));
    m = std::max(m, 1e-30f);  // a zero row divides by a tiny number, not by 0
    row_max[n] = m;
    const float to_steps = kSteps / m;
    uint8_t* kept = bytes + 2 * n * Kp;
    uint8_t* error = kept + Kp;
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[k] * to_steps;
      const float rounded = std::nearbyint(v);  // half to even, as torch.round and fbgemm's quantizer
      kept[k] = static_cast<uint8_t>(static_cast<int>(rounded) + kZeroPoint);
      error[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint((v - rounded) * kErrorScale)) + kZeroPoint);
    }
    for (int64_t k = K; k < Kp; ++k) kept[k] = error[k] = kZeroPoint;  // padding meets zero weights
  }
}

// What the products become: out[n, j] = (kept + error / 126) * row_max[n] / 63 + bias[j], each
// part first dequantized as fbgemm dequantizes, float(sum - 64 * colsum[j]) * scale[j].
struct Epilogue {
  const int32_t* offsets;  // (O,) 64 * the sum of each output channel's int8 weights
  const float* scales;     // (O,) each channel's weight scale
  const float* bias;       // (O,) or null
  const float* row_max;    // (N,)
  float* out;              // (N, O)
  int64_t O;
};

inline float finish(int32_t kept, int32_t error, int64_t n, int64_t j, const Epilogue& e) {
  const float from_kept = static_cast<float>(kept - e.offsets[j]) * e.scales[j];
  const float from_error = static_cast<float>(error - e.offsets[j]) * e.scales[j];
  const float v = std::fma(from_error, 1.f / kErrorScale, from_kept) * (e.row_max[n] / kSteps);
  return e.bias ? v + e.bias[j] : v;
}

// Output blocks [b0, b1) for rows [n0, n0 + R): int32 dot products, then the epilogue.
// w: (blocks, G, 16, 4) int8, a block's 16 channels x 4 inputs per 64 bytes.
template <int R>
void tile_portable(const uint8_t* a, int64_t G, const int8_t* w, int64_t b0, int64_t b1, int64_t n0,
                   const Epilogue& e) {
  for (int64_t b = b0; b < b1; ++b) {
    int32_t acc[2 * R][kBlock] = {};
    const int8_t* wb = w + b * G * kBlock * kGroup;
    for (int64_t g = 0; g < G; ++g)
      for (int r = 0; r < 2 * R; ++r) {
        const uint8_t* x = a + (2 * n0 + r) * G * kGroup + g * kGroup;
        for (int64_t c = 0; c < kBlock; ++c)
          for (int64_t i = 0; i < kGroup; ++i) acc[r][c] += int32_t(x[i]) * wb[(g * kBlock + c) * kGroup + i];
      }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kBlock && b * kBlock + c < e.O; ++c)
        e.out[(n0 + r) * e.O + b * kBlock + c] = finish(acc[2 * r][c], acc[2 * r + 1][c], n0 + r, b * kBlock + c, e);
  }
}

#if defined(__x86_64__)
// AVX2: u8 x s8 pairs into int16 (no saturation: 127 * 127 * 2 < 32767), then pairs into int32.
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const uint8_t* a, int64_t G, const int8_t* w, int64_t b0,
                                                   int64_t b1, int64_t n0, const Epilogue& e) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    __m256i acc[2 * R][2];
    for (int r = 0; r < 2 * R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* wb = w + b * G * kBlock * kGroup;
    for (int64_t g = 0; g < G; ++g) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + 32));
      for (int r = 0; r < 2 * R; ++r) {
        int32_t four;
        std::memcpy(&four, a + (2 * n0 + r) * G * kGroup + g * kGroup, 4);
        const __m256i x = _mm256_set1_epi32(four);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w0), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w1), ones));
      }
    }
    const int64_t j = b * kBlock;
    for (int r = 0; r < R; ++r) {
      if (e.O - j < kBlock) {  // the last, partial block: one channel at a time
        alignas(32) int32_t kept[kBlock], error[kBlock];
        _mm256_store_si256(reinterpret_cast<__m256i*>(kept), acc[2 * r][0]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(kept + 8), acc[2 * r][1]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(error), acc[2 * r + 1][0]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(error + 8), acc[2 * r + 1][1]);
        for (int64_t c = 0; j + c < e.O; ++c) e.out[(n0 + r) * e.O + j + c] = finish(kept[c], error[c], n0 + r, j + c, e);
        continue;
      }
      for (int half = 0; half < 2; ++half) {  // finish() for 8 channels at once, the same operations
        const int64_t at = j + 8 * half;
        const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.offsets + at));
        const __m256 scale = _mm256_loadu_ps(e.scales + at);
        const __m256 from_kept = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[2 * r][half], offset)), scale);
        const __m256 from_error =
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[2 * r + 1][half], offset)), scale);
        __m256 v = _mm256_mul_ps(_mm256_fmadd_ps(from_error, _mm256_set1_ps(1.f / kErrorScale), from_kept),
                                 _mm256_set1_ps(e.row_max[n0 + r] / kSteps));
        if (e.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(e.bias + at));
        _mm256_storeu_ps(e.out + (n0 + r) * e.O + at, v);
      }
    }
  }
}

// AVX-512 VNNI: 64 u8 x s8 products summed into 16 int32 lanes per instruction. C blocks side by
// side: each broadcast of a row's 4 bytes feeds C products (fewer loads per product), and C
// weight streams are read at once. One row (a decode step of one sequence) is memory-bound:
// 4 streams read its weight at about the rate of a plain sum over memory, 2 at 0.6-0.9 of it.
template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline void vnni_blocks(
    const uint8_t* a, int64_t G, const int8_t* w, int64_t b, int64_t n0, const Epilogue& e) {
  __m512i acc[2 * R][C];
  for (int r = 0; r < 2 * R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  const int8_t* wb = w + b * G * kBlock * kGroup;
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(wb + c * G * kBlock * kGroup + g * 64);
    for (int r = 0; r < 2 * R; ++r) {
      int32_t four;
      std::memcpy(&four, a + (2 * n0 + r) * G * kGroup + g * kGroup, 4);
      const __m512i x = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], x, wv[c]);
    }
  }
  for (int c = 0; c < C; ++c) {  // finish() for 16 channels at once: the same operations, in the same order
    const int64_t j = (b + c) * kBlock;
    const __mmask16 real = e.O - j >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << (e.O - j)) - 1);
    const __m512i offset = _mm512_maskz_loadu_epi32(real, e.offsets + j);
    const __m512 scale = _mm512_maskz_loadu_ps(real, e.scales + j);
    const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(real, e.bias + j) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 from_kept = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * r][c], offset)), scale);
      const __m512 from_error =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * r + 1][c], offset)), scale);
      __m512 v = _mm512_mul_ps(_mm512_fmadd_ps(from_error, _mm512_set1_ps(1.f / kErrorScale), from_kept),
                               _mm512_set1_ps(e.row_max[n0 + r] / kSteps));
      if (e.bias) v = _mm512_add_ps(v, bias);
      _mm512_mask_storeu_ps(e.out + (n0 + r) * e.O + j, real, v);
    }
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void tile_vnni(
    const uint8_t* a, int64_t G, const int8_t* w, int64_t b0, int64_t b1, int64_t n0, const Epilogue& e) {
  int64_t b = b0;
  if constexpr (R == 1)  // one row: four weight streams; more rows reuse each load instead
    for (; b + 4 <= b1; b += 4) vnni_blocks<R, 4>(a, G, w, b, n0, e);
  for (; b + 2 <= b1; b += 2) vnni_blocks<R, 2>(a, G, w, b, n0, e);
  if (b < b1) vnni_blocks<R, 1>(a, G, w, b, n0, e);
}
#endif

using Tile = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, const Epilogue&);
using Tiles = std::array<Tile, kRowsPerTile + 1>;  // by rows in the tile, 1..kRowsPerTile

const std::vector<std::pair<std::string, Tiles>>& kernels() {  // widest first, those this CPU runs
  static const auto found = [] {
    std::vector<std::pair<std::string, Tiles>> all;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
      all.push_back({"avx512-vnni", {nullptr, tile_vnni<1>, tile_vnni<2>, tile_vnni<3>, tile_vnni<4>}});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      all.push_back({"avx2", {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>}});
#endif
    all.push_back({"portable", {nullptr, tile_portable<1>, tile_portable<2>, tile_portable<3>, tile_portable<4>}});
    return all;
  }();
  return found;
}

std::atomic<size_t> chosen{0};  // index into kernels(); the widest unless set (tests, benchmarks)

std::string int8_kernel() { return kernels()[chosen].first; }

void use_int8_kernel(const std::string& name) {
  const auto& all = kernels();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].first == name) {
      chosen = i;
      return;
    }
  TORCH_CHECK(false, "int8 kernel ", name, " does not run on this CPU");
}

// x (..., K) fp32; weight (blocks * G * 64,) int8 as int8_pack lays it out; scales, offsets (O,).
// Every argument is checked before any of its memory is read: a caller's mistake is an error,
// never a read past a buffer.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1, "int8_linear: fp32 CPU input");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear: packed int8 weight on the CPU");
  TORCH_CHECK(scales.device().is_cpu() && offsets.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  offsets.scalar_type() == at::kInt && scales.is_contiguous() && offsets.is_contiguous() &&
                  scales.dim() == 1 && scales.numel() == offsets.numel(),
              "int8_linear: scales fp32 and offsets int32 on the CPU, one per output");
  const int64_t K = x.size(-1), O = scales.numel(), G = (K + kGroup - 1) / kGroup, Kp = G * kGroup;
  const int64_t blocks = (O + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.numel() == blocks * G * kBlock * kGroup, "int8_linear: weight packed for another shape");
  at::Tensor bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->numel() == O,
                "int8_linear: bias (O,) fp32 on the CPU");
    bias_values = bias->contiguous();
  }
  const Tiles& tiles = kernels()[chosen].second;
  const at::Tensor rows = x.reshape({-1, K}).contiguous();  // (N, K)
  const int64_t N = rows.size(0);
  std::vector<float> row_max(N);
  std::vector<uint8_t> bytes(2 * N * Kp);  // (N, 2, Kp)
  split_rows(rows.const_data_ptr<float>(), N, K, Kp, row_max.data(), bytes.data());
  at::Tensor y = at::empty({N, O}, rows.options());  // (N, O)
  const Epilogue e{offsets.const_data_ptr<int32_t>(), scales.const_data_ptr<float>(),
                   bias.has_value() ? bias_values.const_data_ptr<float>() : nullptr, row_max.data(),
                   y.mutable_data_ptr<float>(), O};
  const int8_t* w = weight.const_data_ptr<int8_t>();
  // Threads split the output blocks: each reads its own part of the weight (a few rows are
  // memory-bound), and each block's bytes are read once per tile of rows.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (Kp * 2 * N));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t n0 = 0; n0 < N; n0 += kRowsPerTile) {
      const int64_t r = std::min<int64_t>(kRowsPerTile, N - n0);
      tiles[r](bytes.data(), G, w, b0, b1, n0, e);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

// One (row, head): q (hs,) against keys/values (n, hs), positions `step` elements apart.
CLONES void attend_one(const float* q, const float* keys, const float* values, int64_t n, int64_t hs, int64_t step,
                       float scale, float* scores, float* out) {
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

// fp16 -> fp32, n values: F16C's 8 at a time where the CPU has it (GCC leaves _Float16 loops scalar).
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void widen_f16c(const _Float16* from, float* to, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  for (; i < n; ++i) to[i] = static_cast<float>(from[i]);
}
#endif

void widen(const _Float16* from, float* to, int64_t n) {
#if defined(__x86_64__)
  static const bool f16c = (__builtin_cpu_init(), __builtin_cpu_supports("f16c"));
  if (f16c) return widen_f16c(from, to, n);
#endif
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);
}

// An fp16 cache: the head's keys and values widened into `scratch` (2 n hs), then as fp32.
void attend_one(const float* q, const _Float16* keys, const _Float16* values, int64_t n, int64_t hs, int64_t step,
                float scale, float* scores, float* out, std::vector<float>& scratch) {
  scratch.resize(2 * n * hs);
  for (int64_t j = 0; j < n; ++j) {
    widen(keys + j * step, scratch.data() + j * hs, hs);
    widen(values + j * step, scratch.data() + (n + j) * hs, hs);
  }
  attend_one(q, scratch.data(), scratch.data() + n * hs, n, hs, hs, scale, scores, out);
}

void attend_one(const float* q, const float* keys, const float* values, int64_t n, int64_t hs, int64_t step,
                float scale, float* scores, float* out, std::vector<float>&) {
  attend_one(q, keys, values, n, hs, step, scale, scores, out);
}

template <typename T>
void write_and_attend(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, T* key_cache, T* value_cache,
                      const int64_t* positions, int64_t B, int64_t H, int64_t L, int64_t hs, float* out) {
  const int64_t slot_step = H * L * hs, head_step = L * hs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {  // the new key and value (already in the cache's type)
      const int64_t offset = b * slot_step + h * head_step + positions[b] * hs;
      std::memcpy(key_cache + offset, static_cast<const T*>(kc.const_data_ptr()) + (b * H + h) * hs, hs * sizeof(T));
      std::memcpy(value_cache + offset, static_cast<const T*>(vc.const_data_ptr()) + (b * H + h) * hs, hs * sizeof(T));
    }
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {  // one row's heads stay on one thread
    std::vector<float> scores(L), scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H, base = b * slot_step + h * head_step;
      attend_one(qc.const_data_ptr<float>() + i * hs, key_cache + base, value_cache + base, positions[b] + 1, hs, hs,
                 scale, scores.data(), out + i * hs, scratch);
    }
  });
}

// q, k_new, v_new (B, nh, 1, hs) fp32; keys, values (S, nh, L, hs) fp32 or fp16, this layer's cache
// (S >= B slots); positions (B,) int64 -> (B, nh, 1, hs) fp32, laid out as (B, 1, nh, hs) so that
// putting the heads side by side again is a view. Every shape, type and device is checked before
// any pointer is formed, and each position before it is used: a caller's mistake is an error,
// never a write or read outside the cache.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "decode_attention: q (B, nh, 1, hs) fp32 on the CPU");
  TORCH_CHECK(k_new.sizes() == q.sizes() && v_new.sizes() == q.sizes() && k_new.device().is_cpu() &&
                  v_new.device().is_cpu() && at::isFloatingType(k_new.scalar_type()) &&
                  at::isFloatingType(v_new.scalar_type()),
              "decode_attention: k_new and v_new shaped as q, floating point, on the CPU");
  const auto type = keys.scalar_type();
  TORCH_CHECK(keys.dim() == 4 && keys.device().is_cpu() && values.device().is_cpu() && keys.is_contiguous() &&
                  values.is_contiguous() && keys.sizes() == values.sizes() &&
                  (type == at::kFloat || type == at::kHalf) && values.scalar_type() == type,
              "decode_attention: contiguous fp32 or fp16 keys and values (S, nh, L, hs) on the CPU");
  const int64_t B = q.size(0), H = q.size(1), hs = q.size(3), L = keys.size(2);
  TORCH_CHECK(keys.size(0) >= B && keys.size(1) == H && keys.size(3) == hs, "decode_attention: cache shape");
  TORCH_CHECK(positions.dim() == 1 && positions.numel() == B && positions.device().is_cpu() &&
                  at::isIntegralType(positions.scalar_type(), /*includeBool=*/false),
              "decode_attention: positions (B,) integers on the CPU, one per row of q");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t* at_pos = pos.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(at_pos[b] >= 0 && at_pos[b] < L, "decode_attention: position ", at_pos[b], " outside the cache");
  // (B, nh, hs) each, contiguous, for plain indexing
  const at::Tensor qc = q.reshape({B, H, hs}).contiguous();
  // the new key and value in the cache's type: rounded to fp16 by torch (as the torch path does)
  const at::Tensor kc = k_new.reshape({B, H, hs}).to(type).contiguous();
  const at::Tensor vc = v_new.reshape({B, H, hs}).to(type).contiguous();
  at::Tensor y = at::empty({B, 1, H, hs}, q.options());  // (B, 1, nh, hs)
  if (type == at::kFloat) {
    write_and_attend(qc, kc, vc, keys.mutable_data_ptr<float>(), values.mutable_data_ptr<float>(), at_pos, B, H, L,
                     hs, y.mutable_data_ptr<float>());
  } else {  // c10::Half and _Float16 are the same 16 bits
    write_and_attend(qc, kc, vc, reinterpret_cast<_Float16*>(keys.mutable_data_ptr<at::Half>()),
                     reinterpret_cast<_Float16*>(values.mutable_data_ptr<at::Half>()), at_pos, B, H, L, hs,
                     y.mutable_data_ptr<float>());
  }
  return y.transpose(1, 2);  // (B, nh, 1, hs)
}

}  // namespace

TORCH_LIBRARY(gpt2serve, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, Tensor? bias) -> Tensor");
  m.def("int8_kernel() -> str", int8_kernel);
  m.def("use_int8_kernel(str name) -> ()", use_int8_kernel);
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) keys, Tensor(b!) values, Tensor positions)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2serve, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("decode_attention", decode_attention);
}
