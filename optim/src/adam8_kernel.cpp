// Adam over 8-bit block-wise states (NOTE [8-bit states] in adam_kernel.h).
// No LibTorch headers here: compiled with -O3 -ffp-contract=off outside the
// shared precompiled header, as adam_kernel.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "adam_kernel.h"

namespace zero::optim::detail {
namespace {

constexpr float kE4m3Max = 448.0f;
// E4M3 rounding as c10's fp8e4m3fn_from_fp32_value: below the smallest
// normal (2^-6) the value is added to 2^14, whose fp32 spacing is E4M3's
// subnormal step 2^-9, and the FPU rounds; above, the exponent is rebiased
// and the significand rounded to three bits, ties to even.
constexpr uint32_t kMinNormalBits = 121u << 23;           // 2^-6
constexpr uint32_t kOverflowBits = 1087u << 20;           // 480: the first value past 448's rounding range
constexpr uint32_t kDenormMagicBits = 141u << 23;         // 2^14
constexpr uint32_t kNormalBias = (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu;

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

}  // namespace

uint8_t to_e4m3(float x) {
  uint32_t f = bits_of(x);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t r;
  if (f >= kOverflowBits) {
    r = 0x7f;
  } else if (f < kMinNormalBits) {
    r = bits_of(float_of(f) + float_of(kDenormMagicBits)) - kDenormMagicBits;
  } else {
    const uint32_t odd = (f >> 20) & 1u;
    r = (f + kNormalBias + odd) >> 20;
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

// The code 0x7f (E4M3's NaN) decodes as 480 here, as the vector decoders do;
// no finite state produces it (values are scaled to at most 448).
float from_e4m3(uint8_t code) {
  const uint32_t mag = code & 0x7fu;
  const float v = (mag & 0x78u) == 0 ? static_cast<float>(mag & 7u) * 0x1p-9f : float_of((mag << 20) + (120u << 23));
  return float_of(bits_of(v) | (static_cast<uint32_t>(code & 0x80u) << 24));
}

namespace {

// A block's largest magnitudes (a NaN lane skipped, an inf one kept), and a
// sum of its new first moments whose only use is to be finite when they all
// are: a NaN in either moment comes from a NaN or inf gradient (or, with L2
// decay, parameter), which makes the first moment NaN or inf too; an
// overflow of the sum only sends the block down the general path, which
// gives the same codes. A clean block's encoders skip the NaN handling, and
// sqrt(v)'s the sign.
struct Maxima {
  float m = 0, s = 0;
  float probe = 0;
};

// One run's part of a block: dequantize, Adam's update in the fp32 kernel's
// order, the new moments (m, sqrt v) to tm/ts and their largest magnitudes.
void seg_scalar(float* __restrict p, const float* __restrict g, const uint8_t* mc, const uint8_t* vc, float mdq,
                float vdq, int64_t n, const AdamScalars& s, float* tm, float* ts, Maxima& mx) {
  const float ibc2 = 1.0f / s.bias_correction2_sqrt;
  for (int64_t i = 0; i < n; ++i) {
    const float mo = from_e4m3(mc[i]) * mdq;
    const float so = from_e4m3(vc[i]) * vdq;
    const float vo = so * so;
    float gi = g[i];
    float pi = p[i];
    if (s.decoupled) pi = pi * s.decay;
    else gi = gi + s.weight_decay * pi;
    const float mi = mo * s.beta1 + s.one_minus_beta1 * gi;
    const float vi = vo * s.beta2 + s.one_minus_beta2 * gi * gi;
    const float sq = std::sqrt(vi);
    const float denom = sq * ibc2 + s.eps;
    p[i] = pi + s.neg_step_size * mi / denom;
    tm[i] = mi;
    ts[i] = sq;
    const float am = std::fabs(mi);
    mx.m = am > mx.m ? am : mx.m;
    mx.s = sq > mx.s ? sq : mx.s;
    mx.probe += mi;
  }
}

void quant_scalar(const float* t, uint8_t* codes, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = to_e4m3(t[i] * inv);
}
void quant2_scalar(const float* tm, uint8_t* mc, float minv, const float* ts, uint8_t* vc, float vinv, int64_t n,
                   bool) {
  quant_scalar(tm, mc, minv, n);
  quant_scalar(ts, vc, vinv, n);
}

// --- Vector decoding (both ISAs) ---
// Through the F16C conversion: a code sign-extended to 16 bits and shifted
// left by 7 holds E4M3's sign at bit 15 (and again at bit 14), its exponent
// at bits 10-13 and its significand at the top of fp16's ten. With bit 14
// cleared it is the fp16 of the code's value times 2^-8 (exponent bias 15
// against E4M3's 7; subnormals alike, 0x7f as 480), and fp16 widens to fp32
// exactly. The 2^8 joins the block's factor (kDecodeScale): a power of two
// times a power of two, so each product rounds as the scalar decoder's.
constexpr float kDecodeScale = 256.0f;

// --- AVX2 (with F16C): 8 lanes ---
__attribute__((target("avx2,f16c"))) inline __m256 dec_avx2(const uint8_t* c) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))), 7);
  return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xbfff))));
}

// E4M3 codes of x's lanes (already scaled), one per 32-bit lane. kGeneral:
// any value (NaN and inf to 0x7f with their sign); else the block is clean
// (finite values, |x| <= 448), and kSigned says whether x may be negative
// (the first moment; sqrt(v) is not).
template <bool kSigned, bool kGeneral>
__attribute__((target("avx2"))) inline __m256i code_avx2(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i a = kSigned || kGeneral ? _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)) : bits;
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(kNormalBias))), odd), 20);
  const __m256 fs = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f));
  const __m256i sn = _mm256_sub_epi32(_mm256_castps_si256(fs), _mm256_set1_epi32(static_cast<int>(kDenormMagicBits)));
  r = _mm256_blendv_epi8(r, sn, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kMinNormalBits)), a));
  if (kGeneral) {
    const __m256i is_big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(kOverflowBits - 1)));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), is_big);
  }
  if (kSigned || kGeneral)
    r = _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
  return r;
}

template <bool kSigned, bool kGeneral>
__attribute__((target("avx2"))) inline __m256i scaled_code_avx2(const float* t, __m256 k) {
  return code_avx2<kSigned, kGeneral>(_mm256_mul_ps(_mm256_loadu_ps(t), k));
}

// Four vectors of codes (each lane 0..255) to 32 bytes in lane order: two
// saturating packs leave dword d of each 128-bit half holding four codes of
// vector d % 4, and one permutation puts them in order.
__attribute__((target("avx2"))) inline void store4_avx2(__m256i r0, __m256i r1, __m256i r2, __m256i r3,
                                                        uint8_t* out) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(r0, r1), _mm256_packus_epi32(r2, r3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
// One vector of codes of each moment: the packs leave dwords 0 and 4 with
// rm's codes, 1 and 5 with rv's.
__attribute__((target("avx2"))) inline void store2_avx2(__m256i rm, __m256i rv, uint8_t* mout, uint8_t* vout) {
  const __m256i w = _mm256_packus_epi32(rm, rv);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w), _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
  const __m128i x = _mm256_castsi256_si128(b);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(mout), x);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(vout), _mm_unpackhi_epi64(x, x));
}

// The largest lane and the sum of the lanes (lanes hold no NaN for the
// maximum; the sum's order only matters for whether it is finite, which
// routes a block to the general encoder, which gives the same codes).
__attribute__((target("avx2"))) inline float hmax_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
__attribute__((target("avx2"))) inline float hsum_avx2(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// One run's part of a block: seg_scalar's operations.
template <bool kDecoupled>
__attribute__((target("avx2,f16c"))) void seg_avx2_as(float* p, const float* g, const uint8_t* mc, const uint8_t* vc,
                                                       float mdq, float vdq, int64_t n, const AdamScalars& s,
                                                       float* tm, float* ts, Maxima& mx) {
  const __m256 b1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(s.eps), decay_or_wd = _mm256_set1_ps(kDecoupled ? s.decay : s.weight_decay);
  const __m256 ibc2 = _mm256_set1_ps(1.0f / s.bias_correction2_sqrt), step = _mm256_set1_ps(s.neg_step_size);
  const __m256 md = _mm256_set1_ps(mdq * kDecodeScale), vd = _mm256_set1_ps(vdq * kDecodeScale);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 maxm = _mm256_setzero_ps(), maxs = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 mo = _mm256_mul_ps(dec_avx2(mc + i), md);
    const __m256 so = _mm256_mul_ps(dec_avx2(vc + i), vd);
    const __m256 vo = _mm256_mul_ps(so, so);
    __m256 gi = _mm256_loadu_ps(g + i);
    __m256 pi = _mm256_loadu_ps(p + i);
    if (kDecoupled) pi = _mm256_mul_ps(pi, decay_or_wd);
    else gi = _mm256_add_ps(gi, _mm256_mul_ps(decay_or_wd, pi));
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(mo, b1), _mm256_mul_ps(omb1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(vo, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    const __m256 sq = _mm256_sqrt_ps(vi);
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(sq, ibc2), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(step, mi), denom)));
    _mm256_storeu_ps(tm + i, mi);
    _mm256_storeu_ps(ts + i, sq);
    maxm = _mm256_max_ps(_mm256_and_ps(mi, abs_mask), maxm);  // a NaN lane keeps the maximum, as the scalar loop
    maxs = _mm256_max_ps(sq, maxs);
    probe = _mm256_add_ps(probe, mi);
  }
  mx.m = std::max(mx.m, hmax_avx2(maxm));
  mx.s = std::max(mx.s, hmax_avx2(maxs));
  mx.probe += hsum_avx2(probe);
  seg_scalar(p + i, g + i, mc + i, vc + i, mdq, vdq, n - i, s, tm + i, ts + i, mx);
}

void seg_avx2(float* p, const float* g, const uint8_t* mc, const uint8_t* vc, float mdq, float vdq, int64_t n,
              const AdamScalars& s, float* tm, float* ts, Maxima& mx) {
  if (s.decoupled) seg_avx2_as<true>(p, g, mc, vc, mdq, vdq, n, s, tm, ts, mx);
  else seg_avx2_as<false>(p, g, mc, vc, mdq, vdq, n, s, tm, ts, mx);
}

template <bool kGeneral>
__attribute__((target("avx2"))) void quant2_avx2_as(const float* tm, uint8_t* mc, float minv, const float* ts,
                                                     uint8_t* vc, float vinv, int64_t n) {
  const __m256 km = _mm256_set1_ps(minv), kv = _mm256_set1_ps(vinv);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    store4_avx2(scaled_code_avx2<true, kGeneral>(tm + i, km), scaled_code_avx2<true, kGeneral>(tm + i + 8, km),
                scaled_code_avx2<true, kGeneral>(tm + i + 16, km), scaled_code_avx2<true, kGeneral>(tm + i + 24, km),
                mc + i);
    store4_avx2(scaled_code_avx2<false, kGeneral>(ts + i, kv), scaled_code_avx2<false, kGeneral>(ts + i + 8, kv),
                scaled_code_avx2<false, kGeneral>(ts + i + 16, kv), scaled_code_avx2<false, kGeneral>(ts + i + 24, kv),
                vc + i);
  }
  for (; i + 8 <= n; i += 8)
    store2_avx2(scaled_code_avx2<true, kGeneral>(tm + i, km), scaled_code_avx2<false, kGeneral>(ts + i, kv), mc + i,
                vc + i);
  quant_scalar(tm + i, mc + i, minv, n - i);
  quant_scalar(ts + i, vc + i, vinv, n - i);
}

void quant2_avx2(const float* tm, uint8_t* mc, float minv, const float* ts, uint8_t* vc, float vinv, int64_t n,
                 bool clean) {
  if (clean) quant2_avx2_as<false>(tm, mc, minv, ts, vc, vinv, n);
  else quant2_avx2_as<true>(tm, mc, minv, ts, vc, vinv, n);
}

// --- AVX-512F: 16 lanes ---
// As dec_avx2.
__attribute__((target("avx512f"))) inline __m512 dec_avx512(const uint8_t* c) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff))));
}

// As code_avx2, the blends under masks.
template <bool kSigned, bool kGeneral>
__attribute__((target("avx512f"))) inline __m512i code_avx512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i a = kSigned || kGeneral ? _mm512_and_epi32(bits, _mm512_set1_epi32(0x7fffffff)) : bits;
  const __m512i odd = _mm512_and_epi32(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(kNormalBias))), odd), 20);
  const __mmask16 is_sub = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(kMinNormalBits)), a);
  const __m512 fs = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f));
  r = _mm512_mask_sub_epi32(r, is_sub, _mm512_castps_si512(fs), _mm512_set1_epi32(static_cast<int>(kDenormMagicBits)));
  if (kGeneral) {
    const __mmask16 is_big = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(static_cast<int>(kOverflowBits - 1)));
    r = _mm512_mask_mov_epi32(r, is_big, _mm512_set1_epi32(0x7f));
  }
  if (kSigned || kGeneral)
    r = _mm512_or_si512(r, _mm512_and_epi32(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
  return r;
}

__attribute__((target("avx512f"))) inline float hmax_avx512(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hmax_avx2(_mm256_max_ps(_mm512_castps512_ps256(v), hi));
}
__attribute__((target("avx512f"))) inline float hsum_avx512(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum_avx2(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

// As seg_avx2_as, 16 lanes.
template <bool kDecoupled>
__attribute__((target("avx512f"))) void seg_avx512_as(float* p, const float* g, const uint8_t* mc, const uint8_t* vc,
                                                       float mdq, float vdq, int64_t n, const AdamScalars& s,
                                                       float* tm, float* ts, Maxima& mx) {
  const __m512 b1 = _mm512_set1_ps(s.beta1), omb1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(s.eps), decay_or_wd = _mm512_set1_ps(kDecoupled ? s.decay : s.weight_decay);
  const __m512 ibc2 = _mm512_set1_ps(1.0f / s.bias_correction2_sqrt), step = _mm512_set1_ps(s.neg_step_size);
  const __m512 md = _mm512_set1_ps(mdq * kDecodeScale), vd = _mm512_set1_ps(vdq * kDecodeScale);
  __m512 maxm = _mm512_setzero_ps(), maxs = _mm512_setzero_ps(), probe = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 mo = _mm512_mul_ps(dec_avx512(mc + i), md);
    const __m512 so = _mm512_mul_ps(dec_avx512(vc + i), vd);
    const __m512 vo = _mm512_mul_ps(so, so);
    __m512 gi = _mm512_loadu_ps(g + i);
    __m512 pi = _mm512_loadu_ps(p + i);
    if (kDecoupled) pi = _mm512_mul_ps(pi, decay_or_wd);
    else gi = _mm512_add_ps(gi, _mm512_mul_ps(decay_or_wd, pi));
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(mo, b1), _mm512_mul_ps(omb1, gi));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 sq = _mm512_sqrt_ps(vi);
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(sq, ibc2), eps);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(step, mi), denom)));
    _mm512_storeu_ps(tm + i, mi);
    _mm512_storeu_ps(ts + i, sq);
    maxm = _mm512_max_ps(_mm512_abs_ps(mi), maxm);  // a NaN lane keeps the maximum, as the scalar loop
    maxs = _mm512_max_ps(sq, maxs);
    probe = _mm512_add_ps(probe, mi);
  }
  mx.m = std::max(mx.m, hmax_avx512(maxm));
  mx.s = std::max(mx.s, hmax_avx512(maxs));
  mx.probe += hsum_avx512(probe);
  seg_scalar(p + i, g + i, mc + i, vc + i, mdq, vdq, n - i, s, tm + i, ts + i, mx);
}

void seg_avx512(float* p, const float* g, const uint8_t* mc, const uint8_t* vc, float mdq, float vdq, int64_t n,
                const AdamScalars& s, float* tm, float* ts, Maxima& mx) {
  if (s.decoupled) seg_avx512_as<true>(p, g, mc, vc, mdq, vdq, n, s, tm, ts, mx);
  else seg_avx512_as<false>(p, g, mc, vc, mdq, vdq, n, s, tm, ts, mx);
}

// Both moments of a block in one loop.
template <bool kGeneral>
__attribute__((target("avx512f"))) void quant2_avx512_as(const float* tm, uint8_t* mc, float minv, const float* ts,
                                                         uint8_t* vc, float vinv, int64_t n) {
  const __m512 km = _mm512_set1_ps(minv), kv = _mm512_set1_ps(vinv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i cm = code_avx512<true, kGeneral>(_mm512_mul_ps(_mm512_loadu_ps(tm + i), km));
    const __m512i cv = code_avx512<false, kGeneral>(_mm512_mul_ps(_mm512_loadu_ps(ts + i), kv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mc + i), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vc + i), _mm512_cvtepi32_epi8(cv));
  }
  quant_scalar(tm + i, mc + i, minv, n - i);
  quant_scalar(ts + i, vc + i, vinv, n - i);
}

void quant2_avx512(const float* tm, uint8_t* mc, float minv, const float* ts, uint8_t* vc, float vinv, int64_t n,
                   bool clean) {
  if (clean) quant2_avx512_as<false>(tm, mc, minv, ts, vc, vinv, n);
  else quant2_avx512_as<true>(tm, mc, minv, ts, vc, vinv, n);
}

using Seg = void (*)(float*, const float*, const uint8_t*, const uint8_t*, float, float, int64_t, const AdamScalars&,
                     float*, float*, Maxima&);
// (m values, m codes, 448 / m's scale, sqrt v values, their codes, 448 / their scale, n, the block is clean)
using Quant2 = void (*)(const float*, uint8_t*, float, const float*, uint8_t*, float, int64_t, bool);

// A block's scale and the factor its values are multiplied by before
// encoding: 448 / scale; a scale too small for that to be finite (below
// about 1.3e-36: a block whose gradients stopped long ago) is zero, codes
// and all, on every path (the ATen one too).
inline float inverse_of(float& scale) {
  const float inv = kE4m3Max / scale;
  if (scale > 0 && inv <= std::numeric_limits<float>::max()) return inv;
  if (!std::isnan(scale)) scale = 0;
  return 0.0f;
}

}  // namespace

void adam_fused_8bit(float* param, const float* grad, Quantized8 m, Quantized8 v, int64_t n, const AdamRun* runs,
                     int64_t n_runs, Isa isa, uint16_t* low, LowPrecision low_type) {
  const Seg seg = isa == Isa::kAvx512 ? &seg_avx512 : isa == Isa::kAvx2 ? &seg_avx2 : &seg_scalar;
  const Quant2 quant2 = isa == Isa::kAvx512 ? &quant2_avx512 : isa == Isa::kAvx2 ? &quant2_avx2 : &quant2_scalar;
  if (n <= 0) return;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  auto block_range = [&](int64_t b0, int64_t b1) {
    alignas(64) float tm[kQuantBlock], ts[kQuantBlock];
    // The run holding the first element of block b0; runs are in order.
    const AdamRun* r =
        std::upper_bound(runs, runs + n_runs, b0 * kQuantBlock, [](int64_t x, const AdamRun& run) { return x < run.start; }) - 1;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kQuantBlock, len = std::min(kQuantBlock, n - start);
      const float mdq = m.absmax[b] / kE4m3Max, vdq = v.absmax[b] / kE4m3Max;
      Maxima mx;
      for (int64_t at = start; at < start + len;) {
        while (r->start + r->numel <= at) ++r;
        const int64_t end = std::min(start + len, r->start + r->numel);
        seg(param + at, grad + at, m.codes + at, v.codes + at, mdq, vdq, end - at, r->s, tm + (at - start),
            ts + (at - start), mx);
        at = end;
      }
      const float minv = inverse_of(mx.m), vinv = inverse_of(mx.s);
      m.absmax[b] = mx.m;
      v.absmax[b] = mx.s;
      // (A scale that is not finite, in states damaged or made elsewhere,
      // can make every sqrt(v) lane NaN and the maximum 0: the general path.)
      const bool clean =
          std::isfinite(mx.probe) && std::isfinite(mx.m) && std::isfinite(mx.s) && std::isfinite(vdq);
      quant2(tm, m.codes + start, minv, ts, v.codes + start, vinv, len, clean);
      if (low != nullptr && low_type != LowPrecision::kNone) write_low(param + start, low + start, len, low_type);
    }
  };
  constexpr int64_t kGrainBlocks = 128;  // 32K elements, as the fp32 kernel's grain
  if (blocks <= kGrainBlocks) {
    block_range(0, blocks);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, kGrainBlocks),
                    [&](const tbb::blocked_range<int64_t>& br) { block_range(br.begin(), br.end()); });
}

}  // namespace zero::optim::detail

namespace zero::optim {

float dequantize_8bit(uint8_t code, float absmax) { return detail::from_e4m3(code) * (absmax / detail::kE4m3Max); }

void quantize_8bit(const float* values, int64_t n, uint8_t* codes, float* absmax) {
  for (int64_t b = 0; b * detail::kQuantBlock < n; ++b) {
    const int64_t start = b * detail::kQuantBlock, len = std::min(detail::kQuantBlock, n - start);
    float mx = 0;
    for (int64_t i = start; i < start + len; ++i) {
      const float a = std::fabs(values[i]);
      mx = a > mx ? a : mx;
    }
    const float inv = detail::inverse_of(mx);
    absmax[b] = mx;
    detail::quant_scalar(values + start, codes + start, inv, len);
  }
}

}  // namespace zero::optim
