// Adam/AdamW, Adagrad and Lion over flat fp32 slices: one fused pass on the
// CPU (adam_kernel.h), ATen operations elsewhere.
// The order of operations is LibTorch's (torch/csrc/api/src/optim/adamw.cpp),
// so fp32 results agree with torch::optim to rounding.
#include <algorithm>
#include <cmath>
#include <limits>

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

detail::AdamScalars adam_scalars(const config::OptimizerConfig& c, bool decoupled, const StepParams& p) {
  const double wd = p.weight_decay.value_or(c.weight_decay);
  const double bc1 = c.bias_correction ? 1 - std::pow(p.beta1, p.step) : 1.0;
  const double bc2 = c.bias_correction ? 1 - std::pow(p.beta2, p.step) : 1.0;
  return {f32(p.beta1), f32(1 - p.beta1), f32(p.beta2),        f32(1 - p.beta2),   f32(c.eps),
          f32(wd),      f32(1 - p.lr * wd), f32(std::sqrt(bc2)), f32(-p.lr / bc1), decoupled};
}

bool decoupled_of(const config::OptimizerConfig& c) {
  // "AdamW" always decouples weight decay; "Adam" does when adam_w_mode.
  return c.type == config::OptimizerType::kAdamW || c.adam_w_mode;
}

class FlatAdam final : public FlatOptimizer {
 public:
  explicit FlatAdam(config::OptimizerConfig c) : FlatOptimizer(std::move(c)) {
    // "AdamW" always decouples weight decay; "Adam" does when adam_w_mode.
    decoupled_ = config_.type == config::OptimizerType::kAdamW || config_.adam_w_mode;
  }
  int num_states() const override { return 2; }
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }

  bool update_fp32_arrays(const std::vector<Run>& runs, float* param, const float* grad, float* const* states,
                          int64_t) const override {
    for (const Run& r : runs) {
      detail::adam_fused_fp32(param + r.start, grad + r.start, states[0] + r.start, states[1] + r.start, r.numel,
                              adam_scalars(config_, decoupled_, r.params));
    }
    return true;
  }

  bool update_bf16_arrays(const std::vector<Run>& runs, uint16_t* param, const float* grad, uint16_t* const* states,
                          int64_t, const Rounding& rounding) const override {
    for (const Run& r : runs) {
      detail::adam_fused_bf16(param + r.start, grad + r.start, states[0] + r.start, states[1] + r.start, r.numel,
                              adam_scalars(config_, decoupled_, r.params), rounding.stochastic,
                              rounding.index + static_cast<uint64_t>(r.start), rounding.step);
    }
    return true;
  }

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
    // NOTE [device Adam]
    // Any other device or layout (the GPU's states): the fused CPU pass's arithmetic, operation for operation (adam_range),
    // as ATen operations: each one rounded result, none fused with the next
    // (an ATen kernel does one operation; a scalar alpha of 1 is exact), the
    // same float constants, sqrt and division correctly rounded (on the CPU
    // ATen's sqrt is not always: through fp64 it is). So a step on the device
    // equals the same step offloaded to the CPU, bit for bit, and so does
    // training with offload_optimizer and without (2026-11-27 on the card:
    // ATen's own fused add(alpha)/addcmul/addcdiv order left the two 1.6e-5
    // apart after 10 steps of bf16 training).
    const detail::AdamScalars s = adam_scalars(config_, decoupled_, p);
    auto d = [](float x) { return static_cast<double>(x); };
    at::Tensor g = grad;
    if (s.decoupled && s.decay != 1.0f) param.mul_(d(s.decay));  // (a product by 1 is exact: skipped)
    if (!s.decoupled) g = grad.add(param.mul(d(s.weight_decay)));
    exp_avg.mul_(d(s.beta1)).add_(g.mul(d(s.one_minus_beta1)));
    exp_avg_sq.mul_(d(s.beta2)).add_(g.mul(d(s.one_minus_beta2)).mul_(g));
    at::Tensor denom = exp_avg_sq.is_cpu() ? exp_avg_sq.to(at::kDouble).sqrt().to(at::kFloat) : exp_avg_sq.sqrt();
    // A division by a tensor on the device, not by a scalar: ATen's CUDA
    // kernel multiplies by the reciprocal of a CPU scalar, which rounds twice.
    denom.div_(at::scalar_tensor(d(s.bias_correction2_sqrt), denom.options())).add_(d(s.eps));
    param.add_(exp_avg.mul(d(s.neg_step_size)).div_(denom));
    if (low != nullptr) low->copy_(param);
  }

 private:
  bool decoupled_ = true;
};

// Adam with both moments in 8 bits (NOTE [8-bit states] in adam_kernel.h):
// the fused pass on contiguous CPU tensors, adam_8bit_aten elsewhere; the
// blocks marked fp32 (min_8bit_size) by fp32 Adam over the side states.
class FlatAdam8 final : public FlatOptimizer {
 public:
  explicit FlatAdam8(config::OptimizerConfig c) : FlatOptimizer(std::move(c)), fp32_(fp32_config(config_)) {}
  int num_states() const override { return 6; }
  std::vector<std::string> state_names() const override {
    return {"exp_avg.q8", "exp_avg.absmax", "exp_avg_sq.sqrt_q8", "exp_avg_sq.sqrt_absmax",
            "exp_avg.fp32_blocks", "exp_avg_sq.fp32_blocks"};
  }
  std::vector<StateSpec> state_specs() const override {
    const auto names = state_names();
    return {{names[0], at::kByte, 0, 0.0},
            {names[1], at::kFloat, detail::kQuantBlock, 0.0},
            {names[2], at::kByte, 0, 0.0},
            {names[3], at::kFloat, detail::kQuantBlock, 0.0},
            {names[4], at::kFloat, detail::kQuantBlock, 0.0, /*side=*/true},
            {names[5], at::kFloat, detail::kQuantBlock, 0.0, /*side=*/true}};
  }
  void update(const StepParams& p, at::Tensor& param, const at::Tensor& grad, std::vector<at::Tensor>& states,
              at::Tensor* low) const override {
    update_runs({Run{0, param.numel(), p}}, param, grad, states, low);
  }
  // `states`: the four of the 8-bit blocks, then (optionally) the two side
  // states of the blocks marked fp32 (mark_fp32_blocks): those blocks are
  // stepped by fp32 Adam, the rest a stretch of 8-bit blocks at a time.
  void update_runs(const std::vector<Run>& runs, at::Tensor& param, const at::Tensor& grad,
                   std::vector<at::Tensor>& states, at::Tensor* low) const override {
    ZERO_CHECK(states.size() == 4 || states.size() == 6,
               "8-bit Adam needs four state tensors (codes and scales of two moments) and the two fp32 ones");
    const int64_t n = param.numel(), block = detail::kQuantBlock, blocks = (n + block - 1) / block;
    ZERO_CHECK(states[0].numel() == n && states[2].numel() == n && states[1].numel() == blocks &&
                   states[3].numel() == blocks && grad.numel() == n,
               "8-bit Adam: state sizes do not match the parameters");
    if (states.size() == 4) return update_8bit(runs, param, grad, states, low);
    // Stretches of blocks: 8-bit ones, and fp32 ones whose side places follow each other.
    const at::Tensor scales = states[1].device().is_cpu() ? states[1].contiguous() : states[1].to(at::kCPU);
    const float* sc = scales.data_ptr<float>();
    int64_t b = 0;
    while (b < blocks) {
      const bool fp32 = sc[b] < 0;
      int64_t e = b + 1;
      while (e < blocks && (sc[e] < 0) == fp32 && (!fp32 || sc[e] == sc[e - 1] - 1)) ++e;
      const int64_t a = b * block, len = std::min(e * block, n) - a;
      const auto rs = runs_within(runs, a, len);
      at::Tensor p = param.narrow(0, a, len);
      at::Tensor l = low != nullptr ? low->narrow(0, a, len) : at::Tensor();
      if (fp32) {
        const int64_t side = static_cast<int64_t>(-sc[b] - 1) * block;
        ZERO_CHECK(side >= 0 && side + len <= states[4].numel() && side + len <= states[5].numel(),
                   "8-bit Adam: a block marked fp32 has no place in the fp32 states (damaged states)");
        std::vector<at::Tensor> st{states[4].narrow(0, side, len), states[5].narrow(0, side, len)};
        fp32_.update_runs(rs, p, grad.narrow(0, a, len), st, low != nullptr ? &l : nullptr);
      } else {
        std::vector<at::Tensor> st{states[0].narrow(0, a, len), states[1].narrow(0, b, e - b),
                                   states[2].narrow(0, a, len), states[3].narrow(0, b, e - b)};
        update_8bit(rs, p, grad.narrow(0, a, len), st, low != nullptr ? &l : nullptr);
      }
      b = e;
    }
  }

 private:
  static config::OptimizerConfig fp32_config(config::OptimizerConfig c) {
    c.optim_bits = 32;
    c.bf16_states = false;
    return c;
  }
  void update_8bit(const std::vector<Run>& runs, at::Tensor& param, const at::Tensor& grad,
                   std::vector<at::Tensor>& states, at::Tensor* low) const {
    const int64_t n = param.numel();
    const bool fused = fusable({&param, &grad, &states[1], &states[3]}) && states[0].is_cpu() &&
                       states[2].is_cpu() && states[0].is_contiguous() && states[2].is_contiguous() &&
                       states[0].scalar_type() == at::kByte && states[2].scalar_type() == at::kByte;
    if (!fused) {
      adam_8bit_aten(runs, config_, param, grad, states, low);
      return;
    }
    std::vector<detail::AdamRun> rs;
    for (const Run& r : runs) rs.push_back({r.start, r.numel, adam_scalars(config_, decoupled_of(config_), r.params)});
    const LowTarget out = low_target(low);
    detail::adam_fused_8bit(param.data_ptr<float>(), grad.data_ptr<float>(),
                            {states[0].data_ptr<uint8_t>(), states[1].data_ptr<float>()},
                            {states[2].data_ptr<uint8_t>(), states[3].data_ptr<float>()}, n, rs.data(),
                            static_cast<int64_t>(rs.size()), detail::best_isa(), out.data, out.type);
    if (low != nullptr && out.data == nullptr) low->copy_(param);
  }
  FlatAdam fp32_;  // the blocks kept in fp32
};

// torch::optim::Adagrad without lr_decay (DeepSpeed's CPU Adagrad has none).
class FlatAdagrad final : public FlatOptimizer {
 public:
  explicit FlatAdagrad(config::OptimizerConfig c) : FlatOptimizer(std::move(c)) {}
  int num_states() const override { return 1; }
  std::vector<std::string> state_names() const override { return {"sum"}; }
  double initial_state(int) const override { return config_.initial_accumulator_value; }
  bool update_fp32_arrays(const std::vector<Run>& runs, float* param, const float* grad, float* const* states,
                          int64_t) const override {
    for (const Run& r : runs) {
      const double wd = r.params.weight_decay.value_or(config_.weight_decay);
      detail::adagrad_fused_fp32(param + r.start, grad + r.start, states[0] + r.start, r.numel,
                                 {f32(wd), wd != 0, f32(config_.eps), f32(-r.params.lr)});
    }
    return true;
  }
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
  bool update_fp32_arrays(const std::vector<Run>& runs, float* param, const float* grad, float* const* states,
                          int64_t) const override {
    for (const Run& r : runs) {
      const StepParams& p = r.params;
      const double wd = p.weight_decay.value_or(config_.weight_decay);
      detail::lion_fused_fp32(param + r.start, grad + r.start, states[0] + r.start, r.numel,
                              {f32(1 - p.lr * wd), wd != 0, f32(p.beta1), f32(1 - p.beta1), f32(p.beta2),
                               f32(1 - p.beta2), f32(-p.lr)});
    }
    return true;
  }
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

std::vector<FlatOptimizer::StateSpec> FlatOptimizer::state_specs() const {
  std::vector<StateSpec> specs;
  const auto names = state_names();
  // bf16.bf16_optimizer_states: bf16, widened for each update (NOTE [16-bit master]).
  const at::ScalarType dtype = config_.bf16_states ? at::kBFloat16 : at::kFloat;
  for (int i = 0; i < num_states(); ++i) specs.push_back({names[static_cast<size_t>(i)], dtype, 0, initial_state(i)});
  return specs;
}

bool FlatOptimizer::elementwise_states() const {
  for (const auto& s : state_specs())
    if (s.per_block != 0 || s.dtype == at::kByte) return false;
  return true;
}

double FlatOptimizer::state_bytes_per_param() const {
  double b = 0;
  for (const auto& s : state_specs())  // (a side state's length is the layout's: not per parameter)
    if (!s.side) b += static_cast<double>(c10::elementSize(s.dtype)) / static_cast<double>(s.per_block > 0 ? s.per_block : 1);
  return b;
}

void FlatOptimizer::update_runs(const std::vector<Run>& runs, at::Tensor& param, const at::Tensor& grad,
                                std::vector<at::Tensor>& states, at::Tensor* low) const {
  ZERO_CHECK(elementwise_states(), "an optimizer with block-wise states must override update_runs");
  for (const Run& r : runs) {
    at::Tensor p = param.narrow(0, r.start, r.numel);
    std::vector<at::Tensor> s;
    for (auto& t : states) s.push_back(t.narrow(0, r.start, r.numel));
    at::Tensor l = low != nullptr ? low->narrow(0, r.start, r.numel) : at::Tensor();
    update(r.params, p, grad.narrow(0, r.start, r.numel), s, low != nullptr ? &l : nullptr);
  }
}

namespace {

// adam_8bit_aten over one window of whole blocks (runs relative to it).
void adam_8bit_aten_window(const std::vector<FlatOptimizer::Run>& runs, const config::OptimizerConfig& config,
                           at::Tensor param, const at::Tensor& grad, std::vector<at::Tensor>& states, at::Tensor* low) {
  const int64_t n = param.numel(), block = detail::kQuantBlock, blocks = (n + block - 1) / block;
  const auto opts = param.options().dtype(at::kFloat);
  const at::Tensor e4m3_max = at::full({1}, 448.0, opts);
  // Per-element dequantization factors: each block's scale / 448.
  auto per_element = [&](const at::Tensor& per_block) {
    return per_block.repeat_interleave(block).narrow(0, 0, n);
  };
  auto dequant = [&](const at::Tensor& codes, const at::Tensor& absmax) {
    return codes.contiguous().view(at::kFloat8_e4m3fn).to(at::kFloat).mul(per_element(absmax.div(e4m3_max)));
  };
  const at::Tensor mo = dequant(states[0], states[1]);
  const at::Tensor so = dequant(states[2], states[3]);
  const at::Tensor vo = so.mul(so);
  at::Tensor tm = at::empty({n}, opts), ts = at::empty({n}, opts);
  const bool decoupled = decoupled_of(config);
  for (const auto& r : runs) {
    const detail::AdamScalars s = adam_scalars(config, decoupled, r.params);
    auto sl = [&](const at::Tensor& t) { return t.narrow(0, r.start, r.numel); };
    at::Tensor p = sl(param);
    at::Tensor g = sl(grad);
    at::Tensor pi = s.decoupled ? p.mul(static_cast<double>(s.decay)) : p;
    if (!s.decoupled) g = g.add(p.mul(static_cast<double>(s.weight_decay)));
    const at::Tensor mi = sl(mo).mul(static_cast<double>(s.beta1)).add(g.mul(static_cast<double>(s.one_minus_beta1)));
    const at::Tensor vi =
        sl(vo).mul(static_cast<double>(s.beta2)).add(g.mul(static_cast<double>(s.one_minus_beta2)).mul(g));
    // ATen's CPU sqrt (SLEEF) is off by an ulp at times; through fp64 it is
    // the correctly rounded one, as the fused pass's sqrt instruction.
    const at::Tensor sq = vi.to(at::kDouble).sqrt().to(at::kFloat);
    const at::Tensor ibc2 = at::full({1}, 1.0, opts).div(at::full({1}, static_cast<double>(s.bias_correction2_sqrt), opts));
    const at::Tensor denom = sq.mul(ibc2).add(static_cast<double>(s.eps));
    p.copy_(pi.add(mi.mul(static_cast<double>(s.neg_step_size)).div(denom)));
    sl(tm).copy_(mi);
    sl(ts).copy_(sq);
  }
  // Requantize each block against its new largest magnitude (NaN lanes
  // skipped, as the fused pass's maxima do); a scale whose inverse is not
  // finite is zero, codes and all.
  auto requant = [&](const at::Tensor& t, at::Tensor& codes, at::Tensor& absmax) {
    const at::Tensor mag = at::constant_pad_nd(t.abs().nan_to_num(0.0, std::numeric_limits<double>::infinity()), {0, blocks * block - n});
    at::Tensor amax = mag.view({blocks, block}).amax(1);
    const at::Tensor inv_raw = e4m3_max.div(amax);
    const at::Tensor ok = amax.gt(0).logical_and(inv_raw.le(std::numeric_limits<float>::max()));
    amax = at::where(ok, amax, at::zeros_like(amax));
    const at::Tensor inv = at::where(ok, inv_raw, at::zeros_like(amax));
    codes.copy_(t.mul(per_element(inv)).to(at::kFloat8_e4m3fn).view(at::kByte));
    absmax.copy_(amax);
  };
  requant(tm, states[0], states[1]);
  requant(ts, states[2], states[3]);
  if (low != nullptr) low->copy_(param);
}

}  // namespace

void adam_8bit_aten(const std::vector<FlatOptimizer::Run>& runs, const config::OptimizerConfig& config,
                    at::Tensor& param, const at::Tensor& grad, std::vector<at::Tensor>& states, at::Tensor* low) {
  // Windows of whole blocks bound the temporaries (about 48 bytes an element
  // of the window) whatever the sub-group's size.
  constexpr int64_t kWindow = int64_t{1} << 22;
  const int64_t n = param.numel(), block = detail::kQuantBlock;
  for (int64_t a = 0; a < n; a += kWindow) {
    const int64_t len = std::min(kWindow, n - a);
    const std::vector<FlatOptimizer::Run> window_runs = runs_within(runs, a, len);
    std::vector<at::Tensor> st{states[0].narrow(0, a, len), states[1].narrow(0, a / block, (len + block - 1) / block),
                               states[2].narrow(0, a, len), states[3].narrow(0, a / block, (len + block - 1) / block)};
    at::Tensor l = low != nullptr ? low->narrow(0, a, len) : at::Tensor();
    adam_8bit_aten_window(window_runs, config, param.narrow(0, a, len), grad.narrow(0, a, len), st,
                          low != nullptr ? &l : nullptr);
  }
}

std::vector<FlatOptimizer::Run> runs_within(const std::vector<FlatOptimizer::Run>& runs, int64_t start, int64_t numel) {
  std::vector<FlatOptimizer::Run> out;
  for (const auto& r : runs) {
    const int64_t b = std::max(start, r.start), e = std::min(start + numel, r.start + r.numel);
    if (e > b) out.push_back({b - start, e - b, r.params});
  }
  return out;
}

at::Tensor state_window(const FlatOptimizer::StateSpec& spec, const at::Tensor& state, int64_t a, int64_t len) {
  if (spec.side) return state;
  if (spec.per_block > 0) return state.narrow(0, a / spec.per_block, spec.numel_for(len));
  return state.narrow(0, a, len);
}

void mark_fp32_blocks(const std::vector<int64_t>& fp32_blocks, std::vector<at::Tensor>& states) {
  if (fp32_blocks.empty()) return;
  ZERO_CHECK(states.size() == 6, "mark_fp32_blocks: 8-bit Adam's six states");
  const int64_t block = detail::kQuantBlock, count = static_cast<int64_t>(fp32_blocks.size());
  ZERO_CHECK(states[4].numel() >= count * block && states[5].numel() >= count * block,
             "mark_fp32_blocks: the fp32 states are too short");
  at::Tensor index = at::empty({count}, at::kLong), marks = at::empty({count}, at::kFloat);
  for (int64_t j = 0; j < count; ++j) {
    index.data_ptr<int64_t>()[j] = fp32_blocks[static_cast<size_t>(j)];
    marks.data_ptr<float>()[j] = static_cast<float>(-(j + 1));
  }
  const at::Device dev = states[1].device();
  index = index.to(dev);
  marks = marks.to(dev);
  states[1].index_copy_(0, index, marks);
  states[3].index_copy_(0, index, marks);
  // The blocks' codes zero: in place on the CPU, by one indexed fill elsewhere.
  const int64_t n = states[0].numel();
  if (states[0].is_cpu() && states[2].is_cpu() && states[0].is_contiguous() && states[2].is_contiguous()) {
    for (int64_t b : fp32_blocks) {
      const int64_t a = b * block, len = std::min(block, n - a);
      std::fill_n(states[0].data_ptr<uint8_t>() + a, len, uint8_t{0});
      std::fill_n(states[2].data_ptr<uint8_t>() + a, len, uint8_t{0});
    }
    return;
  }
  std::vector<int64_t> elements;
  for (int64_t b : fp32_blocks)
    for (int64_t e = b * block; e < std::min((b + 1) * block, n); ++e) elements.push_back(e);
  const at::Tensor where = at::tensor(elements, at::kLong).to(states[0].device());
  states[0].index_fill_(0, where, 0);
  states[2].index_fill_(0, where, 0);
}

void store_8bit(const float* m, const float* s, const float* v, int64_t n, const std::vector<int64_t>& fp32_blocks,
                std::vector<at::Tensor>& states) {
  ZERO_CHECK(states.size() == 4 || states.size() == 6, "store_8bit: 8-bit Adam's states");
  const int64_t block = detail::kQuantBlock, blocks = (n + block - 1) / block;
  at::Tensor codes = at::empty({n}, at::kByte), scale = at::empty({blocks}, at::kFloat);
  quantize_8bit(m, n, codes.data_ptr<uint8_t>(), scale.data_ptr<float>());
  states[0].copy_(codes);
  states[1].copy_(scale);
  quantize_8bit(s, n, codes.data_ptr<uint8_t>(), scale.data_ptr<float>());
  states[2].copy_(codes);
  states[3].copy_(scale);
  if (fp32_blocks.empty()) return;
  ZERO_CHECK(states.size() == 6, "store_8bit: blocks kept in fp32 need the fp32 states");
  mark_fp32_blocks(fp32_blocks, states);
  at::Tensor sm = at::zeros({states[4].numel()}, at::kFloat), sv = at::zeros({states[5].numel()}, at::kFloat);
  for (size_t j = 0; j < fp32_blocks.size(); ++j) {
    const int64_t a = fp32_blocks[j] * block, len = std::min(block, n - a), side = static_cast<int64_t>(j) * block;
    std::copy(m + a, m + a + len, sm.data_ptr<float>() + side);
    std::copy(v + a, v + a + len, sv.data_ptr<float>() + side);
  }
  states[4].copy_(sm);
  states[5].copy_(sv);
}

const char* cpu_adam_isa() { return detail::to_string(detail::best_isa()); }

std::unique_ptr<FlatOptimizer> FlatOptimizer::create(const config::OptimizerConfig& config) {
  switch (config.type) {
    case config::OptimizerType::kAdam:
    case config::OptimizerType::kAdamW:
      if (config.optim_bits == 8) return std::make_unique<FlatAdam8>(config);
      return std::make_unique<FlatAdam>(config);
    case config::OptimizerType::kAdagrad: return std::make_unique<FlatAdagrad>(config);
    case config::OptimizerType::kLion: return std::make_unique<FlatLion>(config);
  }
  throw ConfigError({"optimizer.type: \"" + config.type_name + "\" is not implemented by zero"});
}

}  // namespace zero::optim
