// Widening 16-bit floats to fp32 and rounding fp32 back, to nearest or
// stochastically, and Adam over a bf16 master and bf16 moments in one pass
// (NOTE [16-bit master] in flat_optimizer.h): branch-free loops the compiler
// vectorises, compiled once per instruction set and chosen at run time,
// every one the same bits (IEEE operations in the same order, no FMA).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "adam_kernel.h"

namespace zero::optim::detail {
namespace {

#define ZERO_INLINE inline __attribute__((always_inline))
#define ZERO_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")))

// The ISA of these kernels: their AVX-512 copy packs 16-bit lanes (BW, VL,
// DQ besides F), so it runs where the CPU has all four; else AVX2's.
Isa isa_16bit() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return isa;
}
#define ZERO_AVX2 __attribute__((target("avx2")))

// f's body compiled for each ISA, chosen at run time.
#define ZERO_DISPATCH(name, params, args)                   \
  ZERO_AVX512 void name##_avx512 params { name##_body args; } \
  ZERO_AVX2 void name##_avx2 params { name##_body args; }     \
  void name##_scalar params { name##_body args; }             \
  void name params {                                          \
    switch (isa_16bit()) {                                    \
      case Isa::kAvx512: return name##_avx512 args;           \
      case Isa::kAvx2: return name##_avx2 args;               \
      case Isa::kScalar: break;                               \
    }                                                         \
    name##_scalar args;                                       \
  }

inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp16 -> fp32 without branches: a normal half's exponent and significand
// shifted into place and rescaled by 2^-112; a subnormal's significand
// placed under a fixed exponent and that exponent's value subtracted.
inline float fp16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // the sign shifted out
  const float normal = as_float((two_w >> 4) + (uint32_t{0xE0} << 23)) * as_float(0x07800000u);  // x 2^-112
  const float subnormal = as_float((two_w >> 17) | (uint32_t{126} << 23)) - 0.5f;
  return as_float(sign | (two_w < (uint32_t{1} << 27) ? as_bits(subnormal) : as_bits(normal)));
}

inline uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// bf16: to nearest even, or the top half after adding 16 random bits; NaN quiet.
inline uint16_t bf16_of(uint32_t b, uint32_t r, bool stochastic) {
  const uint32_t nearest = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t random = (b + (r & 0xFFFFu)) >> 16;
  const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((b >> 16) | 0x40u) : stochastic ? random : nearest);
}

ZERO_INLINE void widen_bf16_body(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = as_float(static_cast<uint32_t>(src[i]) << 16);
}
ZERO_DISPATCH(widen_bf16, (const uint16_t* __restrict src, float* __restrict dst, int64_t n), (src, dst, n))

ZERO_INLINE void widen_fp16_body(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]);
}
ZERO_DISPATCH(widen_fp16, (const uint16_t* __restrict src, float* __restrict dst, int64_t n), (src, dst, n))

// The same with each value multiplied by `mul` (a gradient's unscale, NOTE
// [16-bit gradients]): the bits of widening, then multiplying in fp32.
ZERO_INLINE void widen_bf16_scaled_body(const uint16_t* __restrict src, float* __restrict dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = as_float(static_cast<uint32_t>(src[i]) << 16) * mul;
}
ZERO_DISPATCH(widen_bf16_scaled, (const uint16_t* __restrict src, float* __restrict dst, int64_t n, float mul),
              (src, dst, n, mul))
ZERO_INLINE void widen_fp16_scaled_body(const uint16_t* __restrict src, float* __restrict dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]) * mul;
}
ZERO_DISPATCH(widen_fp16_scaled, (const uint16_t* __restrict src, float* __restrict dst, int64_t n, float mul),
              (src, dst, n, mul))
ZERO_INLINE void scale_fp32_body(const float* __restrict src, float* __restrict dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}
ZERO_DISPATCH(scale_fp32, (const float* __restrict src, float* __restrict dst, int64_t n, float mul), (src, dst, n, mul))

// Element i's word: mix(low word of index + i ^ high_key ^ key), where the
// high word's share is fixed within a span (the caller splits at 2^32 and
// in spans of at most 2^30: the counter is 32-bit, so vectors of 32-bit lanes).
ZERO_INLINE void round_bf16_span_body(const float* __restrict src, uint16_t* __restrict dst, uint32_t n,
                                      bool stochastic, uint32_t low, uint32_t key) {
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = mix((low + i) ^ key);
    dst[i] = bf16_of(as_bits(src[i]), r, stochastic);
  }
}
ZERO_DISPATCH(round_bf16_span,
              (const float* __restrict src, uint16_t* __restrict dst, uint32_t n, bool stochastic, uint32_t low,
               uint32_t key),
              (src, dst, n, stochastic, low, key))

void round_fp16_span(const float* src, uint16_t* dst, uint32_t n, bool stochastic, uint32_t low, uint32_t key) {
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t bits = as_bits(src[i]);
    const uint32_t e = (bits >> 23) & 0xFFu;
    if (!stochastic || e == 255 || e < 103) {
      dst[i] = to_fp16(src[i]);
      continue;
    }
    const uint32_t r = mix((low + i) ^ key);
    const uint32_t drop = (uint32_t{1} << (e >= 113 ? 13 : 126 - e)) - 1;
    dst[i] = to_fp16(as_float((bits + (r & drop)) & ~drop));  // exact: already on fp16's grid
  }
}

// Adam over a bf16 master and bf16 moments in one pass: each element
// widened, stepped with adam_range's operations in its order, and rounded
// back with its three words (the master's, exp_avg's, exp_avg_sq's): the
// same bits as widening, the fp32 kernel and round_16bit one after another.
template <bool kDecoupled>
ZERO_INLINE void adam_bf16_span_body(uint16_t* __restrict p, const float* __restrict g, uint16_t* __restrict m,
                                     uint16_t* __restrict v, uint32_t n, const AdamScalars& s, bool stochastic,
                                     uint32_t low, uint32_t key_p, uint32_t key_m, uint32_t key_v) {
  for (uint32_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = as_float(static_cast<uint32_t>(p[i]) << 16);
    if (kDecoupled) pi = pi * s.decay;
    else gi = gi + s.weight_decay * pi;
    const float mi = as_float(static_cast<uint32_t>(m[i]) << 16) * s.beta1 + s.one_minus_beta1 * gi;
    const float vi = as_float(static_cast<uint32_t>(v[i]) << 16) * s.beta2 + s.one_minus_beta2 * gi * gi;
    const float denom = __builtin_sqrtf(vi) / s.bias_correction2_sqrt + s.eps;
    const float pn = pi + s.neg_step_size * mi / denom;
    const uint32_t j = low + i;
    p[i] = bf16_of(as_bits(pn), mix(j ^ key_p), stochastic);
    m[i] = bf16_of(as_bits(mi), mix(j ^ key_m), stochastic);
    v[i] = bf16_of(as_bits(vi), mix(j ^ key_v), stochastic);
  }
}
ZERO_INLINE void adam_bf16_span_body(uint16_t* __restrict p, const float* __restrict g, uint16_t* __restrict m,
                                     uint16_t* __restrict v, uint32_t n, const AdamScalars& s, bool stochastic,
                                     uint32_t low, uint32_t key_p, uint32_t key_m, uint32_t key_v) {
  if (s.decoupled) adam_bf16_span_body<true>(p, g, m, v, n, s, stochastic, low, key_p, key_m, key_v);
  else adam_bf16_span_body<false>(p, g, m, v, n, s, stochastic, low, key_p, key_m, key_v);
}
ZERO_DISPATCH(adam_bf16_span,
              (uint16_t* __restrict p, const float* __restrict g, uint16_t* __restrict m, uint16_t* __restrict v,
               uint32_t n, const AdamScalars& s, bool stochastic, uint32_t low, uint32_t key_p, uint32_t key_m,
               uint32_t key_v),
              (p, g, m, v, n, s, stochastic, low, key_p, key_m, key_v))

// Spans within one value of the index's high word, of at most 2^30 elements:
// fn(offset, length, low word, high word's share of the key).
template <typename Fn>
void for_spans(uint64_t index, int64_t n, const Fn& fn) {
  for (int64_t at = 0; at < n;) {
    const uint64_t i = index + static_cast<uint64_t>(at);
    const uint64_t to_wrap = (uint64_t{1} << 32) - (i & 0xFFFFFFFFu);
    const int64_t len = static_cast<int64_t>(std::min<uint64_t>({static_cast<uint64_t>(n - at), to_wrap, uint64_t{1} << 30}));
    fn(at, static_cast<uint32_t>(len), static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32) * 0x9E3779B1u);
    at += len;
  }
}

}  // namespace

void adam_fused_bf16(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, int64_t n, const AdamScalars& s,
                     bool stochastic, uint64_t index, int64_t step) {
  const uint32_t kp = rounding_key(step, 0), km = rounding_key(step, 1), kv = rounding_key(step, 2);
  for_spans(index, n, [&](int64_t at, uint32_t len, uint32_t low, uint32_t high) {
    adam_bf16_span(p + at, g + at, m + at, v + at, len, s, stochastic, low, kp ^ high, km ^ high, kv ^ high);
  });
}

void widen_16bit(const uint16_t* src, float* dst, int64_t n, bool bf16) {
  if (bf16) widen_bf16(src, dst, n);
  else widen_fp16(src, dst, n);
}

void widen_16bit(const uint16_t* src, float* dst, int64_t n, bool bf16, float mul) {
  if (bf16) widen_bf16_scaled(src, dst, n, mul);
  else widen_fp16_scaled(src, dst, n, mul);
}

void scale_into(const float* src, float* dst, int64_t n, float mul) { scale_fp32(src, dst, n, mul); }

uint32_t rounding_key(int64_t step, uint32_t stream) {
  return static_cast<uint32_t>(step) * 0x85EBCA77u ^ stream * 0xC2B2AE3Du ^ 0x2545F491u;
}

uint32_t rounding_word(uint64_t index, uint32_t key) {
  return mix(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(index >> 32) * 0x9E3779B1u ^ key);
}

void round_16bit(const float* src, uint16_t* dst, int64_t n, bool bf16, bool stochastic, uint64_t index, uint32_t key) {
  for_spans(index, n, [&](int64_t at, uint32_t len, uint32_t low, uint32_t high) {
    if (bf16) round_bf16_span(src + at, dst + at, len, stochastic, low, key ^ high);
    else round_fp16_span(src + at, dst + at, len, stochastic, low, key ^ high);
  });
}

}  // namespace zero::optim::detail
