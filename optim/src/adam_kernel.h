// The fused CPU optimizer passes over fp32 arrays (internal to optim/): Adam,
// Adagrad and Lion.
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

/// Adagrad (torch::optim::Adagrad without lr_decay):
///   g += weight_decay * p (when has_weight_decay); sum += g * g;
///   p += neg_lr * g / (sqrt(sum) + eps)
struct AdagradScalars {
  float weight_decay;
  bool has_weight_decay;
  float eps;
  float neg_lr;
};

/// Lion, as DeepSpeed's CPU Lion:
///   p *= decay (when has_decay); p += neg_lr * sign(m * beta1 + (1 - beta1) * g);
///   m = m * beta2 + (1 - beta2) * g
struct LionScalars {
  float decay;
  bool has_decay;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_lr;
};

/// The same structure as adam_fused_fp32: one pass, the ISA's kernel with a
/// scalar tail, oneTBB across cores, the optional 16-bit copy in the same pass;
/// each ISA bit-identical to the scalar loop, which matches the ATen
/// operations to rounding (ATen's vector kernels fuse multiply-adds).
void adagrad_fused_fp32(float* param, const float* grad, float* sum, int64_t n, const AdagradScalars& s,
                        Isa isa = best_isa(), uint16_t* low = nullptr, LowPrecision low_type = LowPrecision::kNone);
void lion_fused_fp32(float* param, const float* grad, float* exp_avg, int64_t n, const LionScalars& s,
                     Isa isa = best_isa(), uint16_t* low = nullptr, LowPrecision low_type = LowPrecision::kNone);

}  // namespace zero::optim::detail
