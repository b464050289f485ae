#include "zero/zero/zero_optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/runtime/error.h"

namespace zero::partition {
namespace {

class GradReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(ZeroOptimizer* owner, size_t index) : owner_(owner), index_(index) {}
  void operator()(const torch::autograd::Variable& param) override {
    auto& grad = const_cast<torch::autograd::Variable&>(param).mutable_grad();
    if (!grad.defined()) return;
    owner_->on_grad_ready(index_, grad);
    grad.reset();  // the flat buffer holds it now
  }

 private:
  ZeroOptimizer* owner_;
  size_t index_;
};

at::ScalarType dtype_from_name(const std::string& name) {
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

}  // namespace

at::ScalarType compute_dtype(const config::Config& c) {
  if (c.fp16.enabled) return at::kHalf;
  if (c.bf16.enabled) return at::kBFloat16;
  return at::kFloat;
}

at::ScalarType grad_accum_dtype(const config::Config& c) {
  if (c.grad_accum_dtype) return dtype_from_name(*c.grad_accum_dtype);
  return c.fp16.enabled ? at::kHalf : at::kFloat;
}

ZeroOptimizer::ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                             std::unique_ptr<optim::FlatOptimizer> optimizer,
                             ZeroOptimizerOptions options, MemoryLedger& ledger)
    : options_(options), optimizer_(std::move(optimizer)) {
  ZERO_CHECK(optimizer_ != nullptr, "an optimizer is required");
  flat_ = std::make_unique<FlatParameters>(named_params, options_.compute_dtype, options_.device,
                                           /*world_size=*/1, ledger);
  const int64_t n = flat_->padded_numel();
  grads_ = ledger.empty(n, options_.grad_accum_dtype, options_.device, Tier::kDevice,
                        Kind::kGradients, "flat gradient buffer");
  grads_.zero_();
  master_is_param_ = options_.compute_dtype == at::kFloat;
  if (master_is_param_) {
    master_ = flat_->partition_of(flat_->flat(), 0);
  } else {
    master_ = ledger.empty(flat_->partition_numel(), at::kFloat, options_.device, Tier::kDevice,
                           Kind::kOptimizerStates, "fp32 master parameters");
    master_.copy_(flat_->partition_of(flat_->flat(), 0));
  }
  for (int i = 0; i < optimizer_->num_states(); ++i) {
    auto s = ledger.empty(flat_->partition_numel(), at::kFloat, options_.device, Tier::kDevice,
                          Kind::kOptimizerStates,
                          "optimizer state " + optimizer_->state_names()[i]);
    s.zero_();
    states_.push_back(std::move(s));
  }
  register_hooks();
}

ZeroOptimizer::~ZeroOptimizer() { remove_hooks(); }

void ZeroOptimizer::register_hooks() {
  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(slots[i].param,
                                                   std::make_unique<GradReadyHook>(this, i));
  }
}

void ZeroOptimizer::remove_hooks() {
  if (!flat_) return;
  for (const auto& slot : flat_->slots())
    torch::autograd::impl::set_post_acc_grad_hooks(slot.param, nullptr);
}

void ZeroOptimizer::on_grad_ready(size_t index, const at::Tensor& grad) {
  const auto& slot = flat_->slots()[index];
  grads_.narrow(0, slot.offset, slot.numel).add_(grad.reshape({-1}));
}

void ZeroOptimizer::zero_grad() {
  grads_.zero_();
  for (const auto& slot : flat_->slots()) slot.param.mutable_grad().reset();
}

StepOutcome ZeroOptimizer::step(const optim::StepParams& params, double loss_scale, double clip) {
  at::NoGradGuard no_grad;
  StepOutcome out;
  at::Tensor owned_grads = flat_->partition_of(grads_, 0);
  // One pass for the norm; accumulating in fp32 keeps fp16 squares finite.
  const double scaled_norm =
      at::linalg_vector_norm(owned_grads, 2, c10::nullopt, false, at::kFloat).item<double>();
  out.grad_norm = scaled_norm / loss_scale;
  if (!std::isfinite(scaled_norm) && options_.check_overflow) {
    zero_grad();
    return out;
  }
  // DeepSpeed's unscale_and_clip_grads: one factor for both.
  double combined = loss_scale;
  if (clip > 0) {
    const double ratio = (out.grad_norm + 1e-6) / clip;
    if (ratio > 1) combined = loss_scale * ratio;
  }
  at::Tensor params_flat = flat_->partition_of(flat_->flat(), 0);
  const int64_t n = master_.numel();
  const int64_t chunk = std::max<int64_t>(1, options_.sub_group_size);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    at::Tensor g = owned_grads.narrow(0, start, len);
    at::Tensor g32 = g.scalar_type() == at::kFloat ? g : g.to(at::kFloat);
    if (combined != 1.0) g32.mul_(1.0 / combined);
    at::Tensor m = master_.narrow(0, start, len);
    std::vector<at::Tensor> s;
    for (auto& st : states_) s.push_back(st.narrow(0, start, len));
    optimizer_->update(params, m, g32, s);
    if (!master_is_param_) params_flat.narrow(0, start, len).copy_(m);
  }
  zero_grad();
  out.applied = true;
  return out;
}

double ZeroOptimizer::parameter_l2() const {
  return at::linalg_vector_norm(flat_->flat(), 2, c10::nullopt, false, at::kFloat).item<double>();
}

}  // namespace zero::partition
