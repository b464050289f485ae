// Adam/AdamW, Adagrad and Lion over flat fp32 slices: one fused pass on the
// CPU (adam_kernel.h), ATen operations elsewhere.
// The order of operations is LibTorch's (torch/csrc/api/src/optim/adamw.cpp),
// so fp32 results agree with torch::optim to rounding.
#include <cmath>

#include <ATen/ATen.h>

#include "adam_kernel.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/core/error.h"

namespace zero::optim {
namespace {

// The fused CPU passes apply to contiguous fp32 CPU tensors.
bool fusable(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  }
  return true;
}

// Where a fused pass writes the 16-bit copy: a contiguous fp16/bf16 CPU
// tensor; otherwise none (the caller copies after the pass).
struct LowTarget {
  uint16_t* data = nullptr;
  detail::LowPrecision type = detail::LowPrecision::kNone;
};
LowTarget low_target(at::Tensor* low) {
  if (low == nullptr || !low->device().is_cpu() || !low->is_contiguous()) return {};
  if (low->scalar_type() == at::kHalf) return {static_cast<uint16_t*>(low->data_ptr()), detail::LowPrecision::kFp16};
  if (low->scalar_type() == at::kBFloat16)
    return {static_cast<uint16_t*>(low->data_ptr()), detail::LowPrecision::kBf16};
  return {};
}

float f32(double x) { return static_cast<float>(x); }

class FlatAdam final : public FlatOptimizer {
 public:
  explicit FlatAdam(config::OptimizerConfig c) : FlatOptimizer(std::move(c)) {
    // "AdamW" always decouples weight decay; "Adam" does when adam_w_mode.
    decoupled_ = config_.type == config::OptimizerType::kAdamW || config_.adam_w_mode;
  }
  int num_states() const override { return 2; }
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }

  void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad,
              std::vector<at::Tensor>& states, at::Tensor* low) const override {
    ZERO_CHECK(states.size() == 2, "Adam needs exp_avg and exp_avg_sq");
    auto& exp_avg = states[0];
    auto& exp_avg_sq = states[1];
    const double beta1 = p.beta1, beta2 = p.beta2, wd = p.weight_decay.value_or(config_.weight_decay);
    const double bc1 = config_.bias_correction ? 1 - std::pow(beta1, p.step) : 1.0;
    const double bc2 = config_.bias_correction ? 1 - std::pow(beta2, p.step) : 1.0;
    if (fusable({&param, &grad, &exp_avg, &exp_avg_sq})) {
      const detail::AdamScalars s{f32(beta1),         f32(1 - beta1),       f32(beta2),
                                  f32(1 - beta2),     f32(config_.eps),     f32(wd),
                                  f32(1 - p.lr * wd), f32(std::sqrt(bc2)),  f32(-p.lr / bc1),
                                  decoupled_};
      const LowTarget out = low_target(low);
      detail::adam_fused_fp32(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                              exp_avg_sq.data_ptr<float>(), param.numel(), s, detail::best_isa(), out.data,
                              out.type);
      if (low != nullptr && out.data == nullptr) low->copy_(param);
      return;
    }
    // Any other device or layout: the same math as ATen operations.
    at::Tensor g = grad;
    if (wd != 0) {
      if (decoupled_) param.mul_(1 - p.lr * wd);
      else g = grad.add(param, wd);
    }
    exp_avg.mul_(beta1).add_(g, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2);
    at::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(config_.eps);
    param.addcdiv_(exp_avg, denom, -p.lr / bc1);
    if (low != nullptr) low->copy_(param);
  }

 private:
  bool decoupled_ = true;
};

// torch::optim::Adagrad without lr_decay (DeepSpeed's CPU Adagrad has none).
class FlatAdagrad final : public FlatOptimizer {
 public:
  explicit FlatAdagrad(config::OptimizerConfig c) : FlatOptimizer(std::move(c)) {}
  int num_states() const override { return 1; }
  std::vector<std::string> state_names() const override { return {"sum"}; }
  double initial_state(int) const override { return config_.initial_accumulator_value; }
  void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad,
              std::vector<at::Tensor>& states, at::Tensor* low) const override {
    ZERO_CHECK(states.size() == 1, "Adagrad needs one state");
    if (fusable({&param, &grad, &states[0]})) {
      const double wd = p.weight_decay.value_or(config_.weight_decay);
      const detail::AdagradScalars s{f32(wd), wd != 0, f32(config_.eps), f32(-p.lr)};
      const LowTarget out = low_target(low);
      detail::adagrad_fused_fp32(param.data_ptr<float>(), grad.data_ptr<float>(), states[0].data_ptr<float>(),
                                 param.numel(), s, detail::best_isa(), out.data, out.type);
      if (low != nullptr && out.data == nullptr) low->copy_(param);
      return;
    }
    // Any other device or layout: the same math as ATen operations.
    const double wd = p.weight_decay.value_or(config_.weight_decay);
    at::Tensor g = wd != 0 ? grad.add(param, wd) : grad;
    states[0].addcmul_(g, g, 1.0);
    param.addcdiv_(g, states[0].sqrt().add_(config_.eps), -p.lr);
    if (low != nullptr) low->copy_(param);
  }
};

// Lion (Chen et al. 2023), as DeepSpeed's CPU Lion: decoupled weight decay,
// sign of the interpolated momentum, then the momentum update with beta2.
class FlatLion final : public FlatOptimizer {
 public:
  explicit FlatLion(config::OptimizerConfig c) : FlatOptimizer(std::move(c)) {}
  int num_states() const override { return 1; }
  std::vector<std::string> state_names() const override { return {"exp_avg"}; }
  void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad,
              std::vector<at::Tensor>& states, at::Tensor* low) const override {
    ZERO_CHECK(states.size() == 1, "Lion needs one state");
    auto& m = states[0];
    if (fusable({&param, &grad, &m})) {
      const double wd = p.weight_decay.value_or(config_.weight_decay);
      const double decay = 1 - p.lr * wd;
      const detail::LionScalars s{f32(decay),       wd != 0, f32(p.beta1), f32(1 - p.beta1),
                                  f32(p.beta2),     f32(1 - p.beta2),          f32(-p.lr)};
      const LowTarget out = low_target(low);
      detail::lion_fused_fp32(param.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(), param.numel(),
                              s, detail::best_isa(), out.data, out.type);
      if (low != nullptr && out.data == nullptr) low->copy_(param);
      return;
    }
    // Any other device or layout: the same math as ATen operations.
    if (const double wd = p.weight_decay.value_or(config_.weight_decay); wd != 0) param.mul_(1 - p.lr * wd);
    at::Tensor update = m.mul(p.beta1).add_(grad, 1 - p.beta1).sign_();
    param.add_(update, -p.lr);
    m.mul_(p.beta2).add_(grad, 1 - p.beta2);
    if (low != nullptr) low->copy_(param);
  }
};

}  // namespace

const char* cpu_adam_isa() { return detail::to_string(detail::best_isa()); }

std::unique_ptr<FlatOptimizer> FlatOptimizer::create(const config::OptimizerConfig& config) {
  switch (config.type) {
    case config::OptimizerType::kAdam:
    case config::OptimizerType::kAdamW: return std::make_unique<FlatAdam>(config);
    case config::OptimizerType::kAdagrad: return std::make_unique<FlatAdagrad>(config);
    case config::OptimizerType::kLion: return std::make_unique<FlatLion>(config);
  }
  throw ConfigError({"optimizer.type: \"" + config.type_name + "\" is not implemented by zero"});
}

}  // namespace zero::optim
