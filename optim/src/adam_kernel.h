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

enum class Isa { kScalar, kAvx2, kAvx512 };

/// Optional 16-bit copy of the updated parameters, written in the same pass.
enum class LowPrecision { kNone, kFp16, kBf16 };

/// float -> fp16 / bf16 with round-to-nearest-even, as LibTorch casts.
uint16_t to_fp16(float x);
uint16_t to_bf16(float x);

/// The widest kernel this CPU runs (AVX-512F, else AVX2, else scalar), chosen
/// once from the CPU's features.
Isa best_isa();
const char* to_string(Isa isa);

/// Splits [0, n) across oneTBB's workers; each runs the fused loop of `isa`
/// (default: best_isa()). Every ISA computes the same operations in the same
/// order (multiply, then add: no FMA), so all give bit-identical results.
void adam_fused_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                     const AdamScalars& s, Isa isa = best_isa(), uint16_t* low = nullptr,
                     LowPrecision low_type = LowPrecision::kNone);

}  // namespace zero::optim::detail
