// Widening 16-bit floats to fp32 and rounding fp32 back, to nearest or
// stochastically (NOTE [16-bit master] in flat_optimizer.h): branch-free
// loops the compiler vectorises, one clone per instruction set chosen at
// load time (GCC's target_clones), every clone the same bits.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "adam_kernel.h"

namespace zero::optim::detail {
namespace {

#define ZERO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

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

ZERO_CLONES void widen_bf16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = as_float(static_cast<uint32_t>(src[i]) << 16);
}

ZERO_CLONES void widen_fp16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]);
}

// Element i's word: mix(low word of index + i ^ high_key ^ key), where the
// high word's share is fixed within a span (the caller splits at 2^32).
ZERO_CLONES void round_bf16_span(const float* __restrict src, uint16_t* __restrict dst, int64_t n, bool stochastic,
                                 uint32_t low, uint32_t key) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t r = mix((low + static_cast<uint32_t>(i)) ^ key);
    dst[i] = bf16_of(as_bits(src[i]), r, stochastic);
  }
}

void round_fp16_span(const float* src, uint16_t* dst, int64_t n, bool stochastic, uint32_t low, uint32_t key) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = as_bits(src[i]);
    const uint32_t e = (bits >> 23) & 0xFFu;
    if (!stochastic || e == 255 || e < 103) {
      dst[i] = to_fp16(src[i]);
      continue;
    }
    const uint32_t r = mix((low + static_cast<uint32_t>(i)) ^ key);
    const uint32_t drop = (uint32_t{1} << (e >= 113 ? 13 : 126 - e)) - 1;
    dst[i] = to_fp16(as_float((bits + (r & drop)) & ~drop));  // exact: already on fp16's grid
  }
}

// Adam over a bf16 master and bf16 moments in one pass: each element
// widened, stepped with adam_range's operations in its order, and rounded
// back with its three words (the master's, exp_avg's, exp_avg_sq's): the
// same bits as widening, the fp32 kernel and round_16bit one after another.
template <bool kDecoupled>
ZERO_CLONES void adam_bf16_span(uint16_t* __restrict p, const float* __restrict g, uint16_t* __restrict m,
                                uint16_t* __restrict v, int64_t n, const AdamScalars s, bool stochastic, uint32_t low,
                                uint32_t key_p, uint32_t key_m, uint32_t key_v) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float pi = as_float(static_cast<uint32_t>(p[i]) << 16);
    if (kDecoupled) pi = pi * s.decay;
    else gi = gi + s.weight_decay * pi;
    const float mi = as_float(static_cast<uint32_t>(m[i]) << 16) * s.beta1 + s.one_minus_beta1 * gi;
    const float vi = as_float(static_cast<uint32_t>(v[i]) << 16) * s.beta2 + s.one_minus_beta2 * gi * gi;
    const float denom = __builtin_sqrtf(vi) / s.bias_correction2_sqrt + s.eps;
    const float pn = pi + s.neg_step_size * mi / denom;
    const uint32_t j = low + static_cast<uint32_t>(i);
    p[i] = bf16_of(as_bits(pn), mix(j ^ key_p), stochastic);
    m[i] = bf16_of(as_bits(mi), mix(j ^ key_m), stochastic);
    v[i] = bf16_of(as_bits(vi), mix(j ^ key_v), stochastic);
  }
}

}  // namespace

void adam_fused_bf16(uint16_t* p, const float* g, uint16_t* m, uint16_t* v, int64_t n, const AdamScalars& s,
                     bool stochastic, uint64_t index, int64_t step) {
  const uint32_t keys[3] = {rounding_key(step, 0), rounding_key(step, 1), rounding_key(step, 2)};
  while (n > 0) {
    const uint64_t to_wrap = (uint64_t{1} << 32) - (index & 0xFFFFFFFFu);
    const int64_t len = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(n), to_wrap));
    const uint32_t high = static_cast<uint32_t>(index >> 32) * 0x9E3779B1u;
    auto span = s.decoupled ? &adam_bf16_span<true> : &adam_bf16_span<false>;
    span(p, g, m, v, len, s, stochastic, static_cast<uint32_t>(index), keys[0] ^ high, keys[1] ^ high, keys[2] ^ high);
    p += len, g += len, m += len, v += len;
    index += static_cast<uint64_t>(len);
    n -= len;
  }
}

void widen_16bit(const uint16_t* src, float* dst, int64_t n, bool bf16) {
  if (bf16) widen_bf16(src, dst, n);
  else widen_fp16(src, dst, n);
}

uint32_t rounding_key(int64_t step, uint32_t stream) {
  return static_cast<uint32_t>(step) * 0x85EBCA77u ^ stream * 0xC2B2AE3Du ^ 0x2545F491u;
}

uint32_t rounding_word(uint64_t index, uint32_t key) {
  return mix(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(index >> 32) * 0x9E3779B1u ^ key);
}

void round_16bit(const float* src, uint16_t* dst, int64_t n, bool bf16, bool stochastic, uint64_t index, uint32_t key) {
  while (n > 0) {
    // A span within one value of the index's high word.
    const uint64_t to_wrap = (uint64_t{1} << 32) - (index & 0xFFFFFFFFu);
    const int64_t len = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(n), to_wrap));
    const uint32_t span_key = key ^ static_cast<uint32_t>(index >> 32) * 0x9E3779B1u;
    if (bf16) round_bf16_span(src, dst, len, stochastic, static_cast<uint32_t>(index), span_key);
    else round_fp16_span(src, dst, len, stochastic, static_cast<uint32_t>(index), span_key);
    src += len;
    dst += len;
    index += static_cast<uint64_t>(len);
    n -= len;
  }
}

}  // namespace zero::optim::detail
