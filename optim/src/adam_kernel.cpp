// No LibTorch headers here: this file is compiled with -O3 (loop
// vectorisation) outside the shared precompiled header.
#include "adam_kernel.h"

#include <cmath>
#include <cstring>

#include <immintrin.h>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <vector>

namespace zero::optim::detail {

uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t to_fp16(float x) {
  // IEEE binary16 with round-to-nearest-even (as c10's fp16_ieee_from_fp32_value).
  uint32_t f;
  std::memcpy(&f, &x, sizeof f);
  const uint32_t sign = (f >> 16) & 0x8000u;
  f &= 0x7fffffffu;
  if (f > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);           // NaN
  if (f >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);          // overflow -> inf
  if (f < 0x38800000u) {                                                       // subnormal or zero
    float a;
    std::memcpy(&a, &f, sizeof a);
    const float scaled = a + 0.5f;  // adds the subnormal bits with round-to-nearest-even
    uint32_t r;
    std::memcpy(&r, &scaled, sizeof r);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  const uint32_t mant_odd = (f >> 13) & 1u;
  f += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (f >> 13));
}

void write_low(const float* p, uint16_t* low, int64_t n, LowPrecision type) {
  if (type == LowPrecision::kBf16) {
    for (int64_t i = 0; i < n; ++i) low[i] = to_bf16(p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) low[i] = to_fp16(p[i]);
  }
}

namespace {

void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                float* __restrict v, int64_t n, const AdamScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = p[i];
    if (s.decoupled) pi = pi * s.decay;
    else gi = gi + s.weight_decay * pi;
    const float mi = m[i] * s.beta1 + s.one_minus_beta1 * gi;
    const float vi = v[i] * s.beta2 + s.one_minus_beta2 * gi * gi;  // addcmul: (value * t1) * t2
    const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;
    p[i] = pi + s.neg_step_size * mi / denom;  // addcdiv: (value * t1) / t2
    m[i] = mi;
    v[i] = vi;
  }
}

// The vector kernels: the scalar loop's operations, W lanes at a time, then
// the scalar loop for the tail.
__attribute__((target("avx2"))) void adam_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                                                const AdamScalars& s) {
  const __m256 b1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.weight_decay);
  const __m256 decay = _mm256_set1_ps(s.decay), bc2 = _mm256_set1_ps(s.bias_correction2_sqrt);
  const __m256 step = _mm256_set1_ps(s.neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gi = _mm256_loadu_ps(g + i);
    __m256 pi = _mm256_loadu_ps(p + i);
    if (s.decoupled) pi = _mm256_mul_ps(pi, decay);
    else gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1), _mm256_mul_ps(omb1, gi));
    const __m256 vi =
        _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  adam_range(p + i, g + i, m + i, v + i, n - i, s);
}

__attribute__((target("avx512f"))) void adam_avx512(float* p, const float* g, float* m, float* v, int64_t n,
                                                     const AdamScalars& s) {
  const __m512 b1 = _mm512_set1_ps(s.beta1), omb1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(s.eps), wd = _mm512_set1_ps(s.weight_decay);
  const __m512 decay = _mm512_set1_ps(s.decay), bc2 = _mm512_set1_ps(s.bias_correction2_sqrt);
  const __m512 step = _mm512_set1_ps(s.neg_step_size);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 gi = _mm512_loadu_ps(g + i);
    __m512 pi = _mm512_loadu_ps(p + i);
    if (s.decoupled) pi = _mm512_mul_ps(pi, decay);
    else gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + i), b1), _mm512_mul_ps(omb1, gi));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(step, mi), denom));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
  }
  adam_range(p + i, g + i, m + i, v + i, n - i, s);
}

// Adagrad and Lion: the scalar loops, and the same operations W lanes at a time.
void adagrad_range(float* __restrict p, const float* __restrict g, float* __restrict sum, int64_t n,
                   const AdagradScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    if (s.has_weight_decay) gi = gi + s.weight_decay * p[i];
    const float si = sum[i] + gi * gi;
    p[i] = p[i] + s.neg_lr * gi / (std::sqrt(si) + s.eps);
    sum[i] = si;
  }
}

inline float sign_of(float x) { return static_cast<float>((0.0f < x) - (x < 0.0f)); }  // as ATen's sign

void lion_range(float* __restrict p, const float* __restrict g, float* __restrict m, int64_t n,
                const LionScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    if (s.has_decay) pi = pi * s.decay;
    const float u = sign_of(m[i] * s.beta1 + s.one_minus_beta1 * g[i]);
    p[i] = pi + s.neg_lr * u;
    m[i] = m[i] * s.beta2 + s.one_minus_beta2 * g[i];
  }
}

__attribute__((target("avx2"))) void adagrad_avx2(float* p, const float* g, float* sum, int64_t n,
                                                   const AdagradScalars& s) {
  const __m256 wd = _mm256_set1_ps(s.weight_decay), eps = _mm256_set1_ps(s.eps), lr = _mm256_set1_ps(s.neg_lr);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi = _mm256_loadu_ps(p + i);
    if (s.has_weight_decay) gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
    const __m256 si = _mm256_add_ps(_mm256_loadu_ps(sum + i), _mm256_mul_ps(gi, gi));
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(si), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(lr, gi), denom)));
    _mm256_storeu_ps(sum + i, si);
  }
  adagrad_range(p + i, g + i, sum + i, n - i, s);
}

__attribute__((target("avx512f"))) void adagrad_avx512(float* p, const float* g, float* sum, int64_t n,
                                                        const AdagradScalars& s) {
  const __m512 wd = _mm512_set1_ps(s.weight_decay), eps = _mm512_set1_ps(s.eps), lr = _mm512_set1_ps(s.neg_lr);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 pi = _mm512_loadu_ps(p + i);
    if (s.has_weight_decay) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
    const __m512 si = _mm512_add_ps(_mm512_loadu_ps(sum + i), _mm512_mul_ps(gi, gi));
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(si), eps);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(lr, gi), denom)));
    _mm512_storeu_ps(sum + i, si);
  }
  adagrad_range(p + i, g + i, sum + i, n - i, s);
}

__attribute__((target("avx2"))) void lion_avx2(float* p, const float* g, float* m, int64_t n, const LionScalars& s) {
  const __m256 decay = _mm256_set1_ps(s.decay), b1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2), lr = _mm256_set1_ps(s.neg_lr);
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pi = _mm256_loadu_ps(p + i);
    const __m256 gi = _mm256_loadu_ps(g + i), mi = _mm256_loadu_ps(m + i);
    if (s.has_decay) pi = _mm256_mul_ps(pi, decay);
    const __m256 c = _mm256_add_ps(_mm256_mul_ps(mi, b1), _mm256_mul_ps(omb1, gi));
    const __m256 u = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(zero, c, _CMP_LT_OQ), one),
                                   _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), one));
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_mul_ps(lr, u)));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_mul_ps(mi, b2), _mm256_mul_ps(omb2, gi)));
  }
  lion_range(p + i, g + i, m + i, n - i, s);
}

__attribute__((target("avx512f"))) void lion_avx512(float* p, const float* g, float* m, int64_t n,
                                                     const LionScalars& s) {
  const __m512 decay = _mm512_set1_ps(s.decay), b1 = _mm512_set1_ps(s.beta1), omb1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_beta2), lr = _mm512_set1_ps(s.neg_lr);
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 pi = _mm512_loadu_ps(p + i);
    const __m512 gi = _mm512_loadu_ps(g + i), mi = _mm512_loadu_ps(m + i);
    if (s.has_decay) pi = _mm512_mul_ps(pi, decay);
    const __m512 c = _mm512_add_ps(_mm512_mul_ps(mi, b1), _mm512_mul_ps(omb1, gi));
    const __m512 pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(zero, c, _CMP_LT_OQ), one);
    const __m512 neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), one);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pi, _mm512_mul_ps(lr, _mm512_sub_ps(pos, neg))));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_mul_ps(mi, b2), _mm512_mul_ps(omb2, gi)));
  }
  lion_range(p + i, g + i, m + i, n - i, s);
}

// Runs block(begin, length) over [0, n) on oneTBB's workers, 32K elements a grain.
template <typename Block>
void for_blocks(int64_t n, const Block& block) {
  constexpr int64_t kGrain = 1 << 15;
  if (n <= kGrain) {
    block(0, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kGrain), [&](const tbb::blocked_range<int64_t>& r) {
    block(r.begin(), r.end() - r.begin());
  });
}

using Kernel = void (*)(float*, const float*, float*, float*, int64_t, const AdamScalars&);

Kernel kernel_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return &adam_avx512;
    case Isa::kAvx2: return &adam_avx2;
    case Isa::kScalar: return &adam_range;
  }
  return &adam_range;
}

}  // namespace

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
    // (F16C: the 8-bit kernel's decoder; every AVX2 CPU has it.)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return isa;
}

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
  }
  return "scalar";
}

void adam_fused_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamScalars& s, Isa isa, uint16_t* low, LowPrecision low_type) {
  const Kernel kernel = kernel_for(isa);
  // The 16-bit copy is written per block right after its update, while the
  // block's parameters are still in cache: one pass over memory.
  // 32K elements a grain: 512 KiB over the four arrays.
  for_blocks(n, [&](int64_t b, int64_t len) {
    kernel(param + b, grad + b, exp_avg + b, exp_avg_sq + b, len, s);
    if (low != nullptr && low_type != LowPrecision::kNone) write_low(param + b, low + b, len, low_type);
  });
}

void adagrad_fused_fp32(float* param, const float* grad, float* sum, int64_t n, const AdagradScalars& s, Isa isa,
                        uint16_t* low, LowPrecision low_type) {
  auto kernel = isa == Isa::kAvx512 ? &adagrad_avx512 : isa == Isa::kAvx2 ? &adagrad_avx2 : &adagrad_range;
  for_blocks(n, [&](int64_t b, int64_t len) {
    kernel(param + b, grad + b, sum + b, len, s);
    if (low != nullptr && low_type != LowPrecision::kNone) write_low(param + b, low + b, len, low_type);
  });
}

void lion_fused_fp32(float* param, const float* grad, float* exp_avg, int64_t n, const LionScalars& s, Isa isa,
                     uint16_t* low, LowPrecision low_type) {
  auto kernel = isa == Isa::kAvx512 ? &lion_avx512 : isa == Isa::kAvx2 ? &lion_avx2 : &lion_range;
  for_blocks(n, [&](int64_t b, int64_t len) {
    kernel(param + b, grad + b, exp_avg + b, len, s);
    if (low != nullptr && low_type != LowPrecision::kNone) write_low(param + b, low + b, len, low_type);
  });
}

}  // namespace zero::optim::detail

namespace zero::optim {

namespace {
// The streaming references in the Adam kernel's instruction set, so that a
// compiler's baseline (SSE2) code cannot make them the slower loop.
__attribute__((target("avx512f"))) void triad_avx512(float* a, const float* b, const float* c, float s, int64_t n) {
  const __m512 k = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(b + i), _mm512_mul_ps(k, _mm512_loadu_ps(c + i))));
  for (; i < n; ++i) a[i] = b[i] + s * c[i];
}
__attribute__((target("avx2"))) void triad_avx2(float* a, const float* b, const float* c, float s, int64_t n) {
  const __m256 k = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(k, _mm256_loadu_ps(c + i))));
  for (; i < n; ++i) a[i] = b[i] + s * c[i];
}
void triad_scalar(float* a, const float* b, const float* c, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}
__attribute__((target("avx512f"))) void pattern_avx512(float* p, const float* g, float* m, float* v, float s,
                                                       int64_t n) {
  const __m512 k = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(k, _mm512_loadu_ps(g + i));
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), x));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), x));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), x));
  }
  for (; i < n; ++i) p[i] += s * g[i], m[i] += s * g[i], v[i] += s * g[i];
}
__attribute__((target("avx2"))) void pattern_avx2(float* p, const float* g, float* m, float* v, float s, int64_t n) {
  const __m256 k = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(k, _mm256_loadu_ps(g + i));
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), x));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), x));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), x));
  }
  for (; i < n; ++i) p[i] += s * g[i], m[i] += s * g[i], v[i] += s * g[i];
}
void pattern_scalar(float* p, const float* g, float* m, float* v, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] += s * g[i], m[i] += s * g[i], v[i] += s * g[i];
}
// Σ x² of a block in fp64 (NOTE [gradient norm] in partition/): lane j of 8
// takes the elements at j mod 8 in order, then the lanes are added 0..7.
// Each square is exact in fp64 (24-bit significands), so FMA or not gives
// the same bits, and every ISA the same order: the same result.
__attribute__((target("avx512f"))) double squares_avx512(const float* x, int64_t n) {
  __m512d acc = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512d d = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, acc);
  for (int64_t j = 0; i < n; ++i, ++j) lanes[j] += static_cast<double>(x[i]) * x[i];
  double sum = 0;
  for (double l : lanes) sum += l;
  return sum;
}
__attribute__((target("avx2"))) double squares_avx2(const float* x, int64_t n) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, lo);
  _mm256_store_pd(lanes + 4, hi);
  for (int64_t j = 0; i < n; ++i, ++j) lanes[j] += static_cast<double>(x[i]) * x[i];
  double sum = 0;
  for (double l : lanes) sum += l;
  return sum;
}
double squares_scalar(const float* x, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (int64_t j = 0; i < n; ++i, ++j) lanes[j] += static_cast<double>(x[i]) * x[i];
  double sum = 0;
  for (double l : lanes) sum += l;
  return sum;
}

using Pattern = void (*)(float*, const float*, float*, float*, float, int64_t);
Pattern pattern_for(detail::Isa isa) {
  return isa == detail::Isa::kAvx512 ? &pattern_avx512 : isa == detail::Isa::kAvx2 ? &pattern_avx2 : &pattern_scalar;
}
using Triad = void (*)(float*, const float*, const float*, float, int64_t);
Triad triad_for(detail::Isa isa) {
  return isa == detail::Isa::kAvx512 ? &triad_avx512 : isa == detail::Isa::kAvx2 ? &triad_avx2 : &triad_scalar;
}
}  // namespace

void stream_triad(float* a, const float* b, const float* c, float scalar, int64_t n) {
  const Triad f = triad_for(detail::best_isa());
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 15), [&](const tbb::blocked_range<int64_t>& r) {
    f(a + r.begin(), b + r.begin(), c + r.begin(), scalar, r.end() - r.begin());
  });
}

namespace {

// Σ over fixed blocks of kSumBlock elements, block_sum(b, len) each, summed
// in order after the parallel pass: the same bits whatever the number of
// threads and however oneTBB splits the work.
constexpr int64_t kSumBlock = int64_t{1} << 16;
template <typename BlockSum>
double blocked_sum(int64_t n, const BlockSum& block_sum) {
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(static_cast<size_t>(blocks));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 4), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t b = r.begin(); b < r.end(); ++b)
      partial[static_cast<size_t>(b)] = block_sum(b * kSumBlock, std::min(kSumBlock, n - b * kSumBlock));
  });
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

using Squares = double (*)(const float*, int64_t);
Squares squares_for(detail::Isa isa) {
  return isa == detail::Isa::kAvx512 ? &squares_avx512 : isa == detail::Isa::kAvx2 ? &squares_avx2 : &squares_scalar;
}

}  // namespace

double sum_of_squares_fp64(const float* x, int64_t n, int isa_choice) {
  const detail::Isa isa = isa_choice == 1   ? detail::Isa::kScalar
                          : isa_choice == 2 ? detail::Isa::kAvx2
                          : isa_choice == 3 ? detail::Isa::kAvx512
                                            : detail::best_isa();
  const Squares f = squares_for(isa);
  return blocked_sum(n, [&](int64_t at, int64_t len) { return f(x + at, len); });
}

double sum_of_squares_fp64(const uint16_t* x, int64_t n, bool bf16) {
  // The same blocks, each widened first in the thread's cache: the bits of
  // the fp32 sum over the widened values, the memory reading 2 bytes an
  // element.
  const Squares f = squares_for(detail::best_isa());
  return blocked_sum(n, [&](int64_t at, int64_t len) {
    thread_local std::vector<float> wide;
    wide.resize(static_cast<size_t>(kSumBlock));
    detail::widen_16bit(x + at, wide.data(), len, bf16);
    return f(wide.data(), len);
  });
}

void stream_adam_pattern(float* p, const float* g, float* m, float* v, float scalar, int64_t n) {
  const auto f = pattern_for(detail::best_isa());
  // The four arrays in one loop, as the Adam kernel walks them: the memory
  // sees Adam's streams and traffic, four arrays read and three written back.
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 15), [&](const tbb::blocked_range<int64_t>& r) {
    const int64_t b = r.begin();
    f(p + b, g + b, m + b, v + b, scalar, r.end() - b);
  });
}

}  // namespace zero::optim
