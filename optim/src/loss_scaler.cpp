// fp16 loss scaling; see loss_scaler.h.
//
// This is the scaler DeepSpeed's ZeRO optimizers use (stage 1/2/3 build it
// with CreateLossScaler from fp16.dynamic_loss_scale_args()), including
// hysteresis and the error at the minimum scale. DeepSpeed's non-ZeRO
// FP16_Optimizer has its own simpler rule without hysteresis; zero does not
// reproduce that one.
#include "zero/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "zero/core/error.h"

namespace zero::optim {
namespace {

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace

LossScaler::LossScaler() = default;

LossScaler::LossScaler(const config::Fp16Config& fp16) {
  // DeepSpeed only scales fp16 runs; any other dtype gets a static scale of 1
  // whatever the fp16 section says.
  if (!fp16.enabled) return;
  if (fp16.loss_scale != 0.0) {
    cur_scale_ = fp16.loss_scale;
    return;
  }
  // DeepSpeed's config model rejects these when dynamic scaling is on;
  // checked again here because a window of 0 would be a modulo by zero.
  std::vector<std::string> problems;
  if (fp16.loss_scale_window <= 0) {
    problems.push_back("fp16.loss_scale_window: expected > 0 when dynamic loss scaling is "
                       "enabled (loss_scale=0); got " +
                       std::to_string(fp16.loss_scale_window));
  }
  if (!(fp16.min_loss_scale > 0.0)) {
    problems.push_back("fp16.min_loss_scale: expected > 0 when dynamic loss scaling is "
                       "enabled (loss_scale=0); got " +
                       number(fp16.min_loss_scale));
  }
  if (!problems.empty()) throw ConfigError(std::move(problems));

  dynamic_ = true;
  cur_scale_ = std::ldexp(1.0, static_cast<int>(fp16.initial_scale_power));
  scale_window_ = fp16.loss_scale_window;
  min_scale_ = fp16.min_loss_scale;
  delayed_shift_ = fp16.hysteresis;
  cur_hysteresis_ = fp16.hysteresis;
  consecutive_hysteresis_ = fp16.consecutive_hysteresis;
}

void LossScaler::update(bool overflow) {
  // A static scaler keeps no history (DeepSpeed's LossScaler.update_scale is
  // a no-op); the skipped step is the caller's business.
  if (!dynamic_) return;
  if (overflow) {
    if (delayed_shift_ == 1 || cur_hysteresis_ == 1) {
      // Thrown before any state changes, as DeepSpeed raises before updating.
      if (cur_scale_ == min_scale_) {
        throw DivergedError(
                    "fp16 dynamic loss scaling: gradients overflowed again with the loss scale "
                    "already at fp16.min_loss_scale=" +
                        number(min_scale_) +
                        ", so it cannot be lowered further; the run has diverged. Lower "
                        "fp16.min_loss_scale, or train in bf16 (bf16.enabled) instead of fp16.");
      }
      cur_scale_ = std::max(cur_scale_ / scale_factor_, min_scale_);
    } else {
      --cur_hysteresis_;
    }
    last_overflow_iter_ = cur_iter_;
  } else {
    if (consecutive_hysteresis_) cur_hysteresis_ = delayed_shift_;
    const int64_t stable_interval = cur_iter_ - last_overflow_iter_ - 1;
    if (stable_interval > 0 && stable_interval % scale_window_ == 0) {
      // Without consecutive_hysteresis the hysteresis is refilled only here,
      // so after the first halving every further overflow halves at once
      // until a full window has passed.
      if (!consecutive_hysteresis_) cur_hysteresis_ = delayed_shift_;
      cur_scale_ *= scale_factor_;
    }
  }
  ++cur_iter_;
}

LossScaler::State LossScaler::state() const {
  return State{cur_scale_, cur_iter_, last_overflow_iter_, cur_hysteresis_};
}

void LossScaler::load_state(const State& s) {
  cur_scale_ = s.cur_scale;
  cur_iter_ = s.cur_iter;
  last_overflow_iter_ = s.last_overflow_iter;
  cur_hysteresis_ = s.cur_hysteresis;
}

}  // namespace zero::optim
