// DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py):
// WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, with the
// same formulas and the same step counting, so a config gives the same lr at
// every step as it does under DeepSpeed.
//
// Step counting (as DeepSpeed): a new scheduler has last_batch_iteration -1
// and reports the lr for the first optimizer step; the engine calls step()
// after each optimizer step that was applied (not after an fp16-overflow skip).
// Not thread-safe; owned by the engine.
#pragma once

#include <memory>
#include <optional>

#include "zero/config/config.h"

namespace zero::optim {

class LrScheduler {
 public:
  /// Builds the schedule for `config`. `base_lr` is the optimizer's lr (used
  /// where DeepSpeed reads it from the optimizer, e.g. WarmupLR's
  /// warmup_max_lr when unset, WarmupCosineLR's peak). `base_beta1` likewise
  /// for OneCycle's momentum. Throws zero::ConfigError for invalid params that
  /// DeepSpeed rejects at construction (naming scheduler.params.KEY).
  static std::unique_ptr<LrScheduler> create(const config::SchedulerConfig& config,
                                             double base_lr, double base_beta1 = 0.9);
  virtual ~LrScheduler() = default;

  /// The lr the next optimizer step uses.
  virtual double lr() const = 0;
  /// The beta1 (momentum) the next optimizer step uses, for schedules that
  /// cycle it (OneCycle with cycle_momentum); none otherwise.
  virtual std::optional<double> beta1() const { return std::nullopt; }
  /// Advances by one applied optimizer step.
  void step() { ++last_batch_iteration_; }
  /// DeepSpeed's counter: -1 before the first step().
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  /// Restores the counter (engine checkpoint load).
  void set_last_batch_iteration(int64_t it) { last_batch_iteration_ = it; }

 protected:
  int64_t last_batch_iteration_ = -1;
};

}  // namespace zero::optim
