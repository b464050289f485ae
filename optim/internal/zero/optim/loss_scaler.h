// fp16 loss scaling with DeepSpeed's semantics
// (deepspeed/runtime/fp16/loss_scaler.py: LossScaler and DynamicLossScaler).
//
// Dynamic: starts at 2^initial_scale_power; an overflow consumes one unit of
// hysteresis, and when none is left halves the scale (not below
// min_loss_scale); loss_scale_window clean steps since the last overflow double
// it; consecutive_hysteresis refills the hysteresis on every clean step.
// An overflow at the minimum scale is an error, as in DeepSpeed.
// Static: a fixed scale that never changes; overflows are still reported.
// Not thread-safe; owned by the engine.
#pragma once

#include <cstdint>

#include "zero/config/config.h"

namespace zero::optim {

class LossScaler {
 public:
  /// From the fp16 section: dynamic when loss_scale == 0, else static.
  explicit LossScaler(const config::Fp16Config& fp16);
  /// A static scale of 1 (fp32/bf16 training).
  LossScaler();

  double scale() const { return cur_scale_; }
  bool dynamic() const { return dynamic_; }

  /// Records the outcome of one optimizer step (overflow: the step was
  /// skipped) and updates the scale. Throws zero::Error when a dynamic scaler
  /// overflows at min_loss_scale ("cannot decrease scale below ...; the model
  /// diverged or fp16.min_loss_scale is too high").
  void update(bool overflow);

  // State for engine checkpoints.
  struct State {
    double cur_scale;
    int64_t cur_iter;
    int64_t last_overflow_iter;
    int64_t cur_hysteresis;
  };
  State state() const;
  void load_state(const State& s);

 private:
  bool dynamic_ = false;
  double cur_scale_ = 1.0;
  double scale_factor_ = 2.0;
  double min_scale_ = 1.0;
  int64_t scale_window_ = 1000;
  int64_t delayed_shift_ = 1;
  bool consecutive_hysteresis_ = false;
  int64_t cur_iter_ = 0;
  int64_t last_overflow_iter_ = -1;
  int64_t cur_hysteresis_ = 1;
};

}  // namespace zero::optim
