// The fused CPU Adam pass over fp32 arrays (internal to optim/).
// One pass per element: read param, grad, exp_avg, exp_avg_sq; write param,
// exp_avg, exp_avg_sq. Same order of operations as LibTorch's Adam/AdamW
// (see flat_adam.cpp), so results agree with torch::optim to rounding.
#pragma once

#include <cstdint>

namespace zero::optim::detail {

/// Per-step constants, computed in double and rounded to float once, as ATen
/// does with a Scalar operand.
struct AdamScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;            // L2 mode: added to the gradient as weight_decay * param
  float decay;                   // decoupled mode: param *= 1 - lr * weight_decay
  float bias_correction2_sqrt;   // sqrt(1 - beta2^step), or 1
  float neg_step_size;           // -lr / (1 - beta1^step)
  bool decoupled;
};

/// Splits [0, n) across oneTBB's workers; each runs the fused loop.
void adam_fused_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamScalars& s);

}  // namespace zero::optim::detail
