// No LibTorch headers here: this file is compiled with -O3 (loop
// vectorisation) outside the shared precompiled header.
#include "adam_kernel.h"

#include <cmath>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace zero::optim::detail {
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

}  // namespace

void adam_fused_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamScalars& s) {
  constexpr int64_t kGrain = 1 << 15;  // 32K elements: 512 KiB over the four arrays
  if (n <= kGrain) {
    adam_range(param, grad, exp_avg, exp_avg_sq, n, s);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kGrain), [&](const tbb::blocked_range<int64_t>& r) {
    const int64_t b = r.begin();
    adam_range(param + b, grad + b, exp_avg + b, exp_avg_sq + b, r.end() - b, s);
  });
}

}  // namespace zero::optim::detail
