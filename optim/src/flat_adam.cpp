// Adam/AdamW, Adagrad and Lion over flat fp32 slices, as ATen operations.
// The order of operations is LibTorch's (torch/csrc/api/src/optim/adamw.cpp),
// so fp32 results agree with torch::optim to rounding.
#include <cmath>

#include <ATen/ATen.h>

#include "adam_kernel.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/runtime/error.h"

namespace zero::optim {
namespace {

// The fused CPU pass applies to contiguous fp32 CPU tensors.
bool fusable(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& d) {
  for (const at::Tensor* t : {&a, &b, &c, &d}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  }
  return true;
}

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
    const double beta1 = p.beta1, beta2 = p.beta2, wd = config_.weight_decay;
    const double bc1 = config_.bias_correction ? 1 - std::pow(beta1, p.step) : 1.0;
    const double bc2 = config_.bias_correction ? 1 - std::pow(beta2, p.step) : 1.0;
    if (fusable(param, grad, exp_avg, exp_avg_sq)) {
      auto f = [](double x) { return static_cast<float>(x); };
      const detail::AdamScalars s{f(beta1),           f(1 - beta1),         f(beta2),
                                  f(1 - beta2),       f(config_.eps),       f(wd),
                                  f(1 - p.lr * wd),   f(std::sqrt(bc2)),    f(-p.lr / bc1),
                                  decoupled_};
      const bool fused_low = low != nullptr && low->device().is_cpu() && low->is_contiguous() &&
                             (low->scalar_type() == at::kHalf || low->scalar_type() == at::kBFloat16);
      detail::adam_fused_fp32(param.data_ptr<float>(), grad.data_ptr<float>(),
                              exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                              param.numel(), s, detail::best_isa(),
                              fused_low ? static_cast<uint16_t*>(low->data_ptr()) : nullptr,
                              !fused_low ? detail::LowPrecision::kNone
                              : low->scalar_type() == at::kHalf ? detail::LowPrecision::kFp16
                                                                : detail::LowPrecision::kBf16);
      if (low != nullptr && !fused_low) low->copy_(param);
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
  void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad,
              std::vector<at::Tensor>& states, at::Tensor* low) const override {
    ZERO_CHECK(states.size() == 1, "Adagrad needs one state");
    at::Tensor g = config_.weight_decay != 0 ? grad.add(param, config_.weight_decay) : grad;
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
    if (config_.weight_decay != 0) param.mul_(1 - p.lr * config_.weight_decay);
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
