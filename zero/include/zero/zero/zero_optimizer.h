// The ZeRO optimizer: owns the flat parameters, the gradient buffer, the fp32
// master copy and the optimizer states, and applies one optimizer step at each
// accumulation boundary.
//
// NOTE [gradient path]
// Each trainable parameter gets a post-accumulate-grad hook. When autograd has
// produced a parameter's gradient, the hook adds it into the flat gradient
// buffer (in grad_accum_dtype) and frees the per-parameter gradient, so at
// most a few per-parameter gradients are alive at once and micro-steps
// accumulate in the flat buffer. At the boundary, step() computes the global
// gradient norm (one pass; a non-finite norm is an overflow), then walks the
// owned partition in sub_group_size chunks: convert to fp32, unscale and clip
// by one combined factor (DeepSpeed's unscale_and_clip_grads), update master
// and states, and write the new values back into the compute-dtype
// parameters. Stage 0 on one process owns the whole buffer.
//
// Thread-safety: hooks run on autograd's thread, step() on the caller's; the
// caller (the Engine) does not overlap them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/config/config.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/runtime/memory_ledger.h"
#include "zero/zero/flat_parameters.h"

namespace zero::partition {

struct ZeroOptimizerOptions {
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType grad_accum_dtype = at::kFloat;
  at::Device device = at::kCPU;
  int64_t sub_group_size = 1000000000;
  /// Skip the step when gradients are not finite (fp16 always; bf16 when
  /// bf16.check_grad_overflow).
  bool check_overflow = true;
};

/// What one boundary step did.
struct StepOutcome {
  bool applied = false;   // false: skipped for non-finite gradients
  double grad_norm = 0;   // global L2 norm of the unscaled gradients (inf/nan on overflow)
};

class ZeroOptimizer {
 public:
  /// Takes over `named_params` (rebinding them into a flat buffer) and creates
  /// the states of `optimizer` for the owned partition, all through `ledger`.
  ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                std::unique_ptr<optim::FlatOptimizer> optimizer, ZeroOptimizerOptions options,
                MemoryLedger& ledger);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// One optimizer step from the accumulated gradients, which were produced
  /// by a loss multiplied by `loss_scale`. `clip` > 0 clips the global norm
  /// to it. Gradients are zeroed afterwards, applied or not.
  StepOutcome step(const optim::StepParams& params, double loss_scale, double clip);

  /// Discards accumulated gradients.
  void zero_grad();

  /// Called by the gradient hook of slot `index` (see NOTE [gradient path]).
  void on_grad_ready(size_t index, const at::Tensor& grad);

  const FlatParameters& parameters() const { return *flat_; }
  int64_t num_parameters() const { return flat_->numel(); }
  /// L2 norm of all parameters (the compute-dtype values the model sees), in fp32.
  double parameter_l2() const;
  /// Fp32 master values of the owned partition (the parameters themselves in fp32 training).
  const at::Tensor& master() const { return master_; }
  const std::vector<at::Tensor>& optimizer_states() const { return states_; }
  const optim::FlatOptimizer& optimizer() const { return *optimizer_; }

 private:
  void register_hooks();
  void remove_hooks();

  ZeroOptimizerOptions options_;
  std::unique_ptr<optim::FlatOptimizer> optimizer_;
  std::unique_ptr<FlatParameters> flat_;
  at::Tensor grads_;   // flat, grad_accum_dtype, laid out like flat_
  at::Tensor master_;  // fp32 owned partition; aliases flat_ when compute is fp32
  std::vector<at::Tensor> states_;
  bool master_is_param_ = false;
};

/// The compute dtype a config asks for: fp16, bf16 or fp32.
at::ScalarType compute_dtype(const config::Config& config);
/// The gradient accumulation dtype: data_types.grad_accum_dtype, else
/// DeepSpeed's default for the precision (fp16 -> fp16, bf16 -> fp32, fp32 -> fp32).
at::ScalarType grad_accum_dtype(const config::Config& config);

}  // namespace zero::partition
