// DeepSpeed's lr schedules; see lr_scheduler.h and
// deepspeed/runtime/lr_schedules.py.
//
// Every schedule here is a pure function of last_batch_iteration_, so a
// counter restored from a checkpoint gives the same lr as the uninterrupted
// run. The arithmetic keeps DeepSpeed's operation order (e.g. multiplying by
// a precomputed 1/log(N) rather than dividing by log(N)) so the doubles match
// DeepSpeed's Python floats bit for bit, not just to a tolerance.
#include "zero/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::optim {
namespace {

using config::SchedulerConfig;
using config::WarmupType;

std::string param_problem(const char* key, const char* expected, int64_t got) {
  std::ostringstream out;
  out << "scheduler.params." << key << ": expected " << expected << "; got " << got;
  return out.str();
}

// DeepSpeed: warmup_num_steps must be a positive integer (ValueError), and a
// value of 1 is then silently raised to 2 so that log(N) is not 0.
void check_warmup_num_steps(const SchedulerConfig& c, std::vector<std::string>& problems) {
  if (c.warmup_num_steps <= 0) {
    problems.push_back(param_problem("warmup_num_steps", "a positive integer", c.warmup_num_steps));
  }
}

// The warmup fraction shared by WarmupLR, WarmupDecayLR and WarmupCosineLR,
// for 0 <= it < warmup_num_steps: log(it + 1) / log(N) or it / N.
class WarmupRamp {
 public:
  WarmupRamp(int64_t warmup_num_steps, WarmupType type)
      : num_steps_(std::max<int64_t>(2, warmup_num_steps)),
        type_(type),
        inverse_log_(1.0 / std::log(static_cast<double>(num_steps_))) {}

  int64_t num_steps() const { return num_steps_; }
  double fraction(int64_t it) const {
    if (type_ == WarmupType::kLog) return inverse_log_ * std::log(static_cast<double>(it + 1));
    return static_cast<double>(it) / static_cast<double>(num_steps_);
  }

 private:
  int64_t num_steps_;
  WarmupType type_;
  double inverse_log_;
};

// WarmupLR: min_lr before the first step() and at it == 0, ramps to max_lr at
// it == N, then holds. WarmupDecayLR overrides the post-warmup gamma.
class WarmupLR : public LrScheduler {
 public:
  WarmupLR(const SchedulerConfig& c, double max_lr)
      : ramp_(c.warmup_num_steps, c.warmup_type),
        min_lr_(c.warmup_min_lr),
        delta_lr_(max_lr - c.warmup_min_lr) {}

  double lr() const override {
    // DeepSpeed's get_lr returns min_lrs while last_batch_iteration < 0.
    if (last_batch_iteration_ < 0) return min_lr_;
    return min_lr_ + delta_lr_ * gamma(last_batch_iteration_);
  }

 protected:
  virtual double post_warmup_gamma(int64_t /*it*/) const { return 1.0; }
  const WarmupRamp& ramp() const { return ramp_; }

 private:
  double gamma(int64_t it) const {
    if (it < ramp_.num_steps()) return ramp_.fraction(it);
    return post_warmup_gamma(it);
  }

  WarmupRamp ramp_;
  double min_lr_;
  double delta_lr_;
};

// WarmupDecayLR: WarmupLR, then linear decay reaching min_lr at
// total_num_steps and staying there.
class WarmupDecayLR : public WarmupLR {
 public:
  WarmupDecayLR(const SchedulerConfig& c, double max_lr)
      : WarmupLR(c, max_lr), total_num_steps_(c.total_num_steps) {
    if (total_num_steps_ < c.warmup_num_steps) {
      log::warning("scheduler.params.total_num_steps " + std::to_string(total_num_steps_) +
                   " is less than warmup_num_steps " + std::to_string(c.warmup_num_steps));
    }
  }

 protected:
  double post_warmup_gamma(int64_t it) const override {
    const double remaining = static_cast<double>(total_num_steps_ - it);
    const double span =
        std::max(1.0, static_cast<double>(total_num_steps_ - ramp().num_steps()));
    return std::max(0.0, remaining / span);
  }

 private:
  int64_t total_num_steps_;
};

// WarmupCosineLR: a ratio of the optimizer's lr. 0 before the first step();
// warmup_min_ratio -> 1 over the warmup, then a half cosine down to
// cos_min_ratio at total_num_steps, clamped there.
class WarmupCosineLR : public LrScheduler {
 public:
  WarmupCosineLR(const SchedulerConfig& c, double base_lr)
      : ramp_(c.warmup_num_steps, c.warmup_type),
        base_lr_(base_lr),
        total_num_steps_(c.total_num_steps),
        warmup_min_ratio_(c.warmup_min_ratio),
        cos_min_ratio_(c.cos_min_ratio) {
    if (total_num_steps_ < ramp_.num_steps()) {
      log::warning("scheduler.params.total_num_steps " + std::to_string(total_num_steps_) +
                   " is less than warmup_num_steps " + std::to_string(c.warmup_num_steps));
    }
  }

  double lr() const override {
    if (last_batch_iteration_ < 0) return 0.0;
    return base_lr_ * ratio(last_batch_iteration_);
  }

 private:
  double ratio(int64_t it) const {
    if (it < ramp_.num_steps()) {
      return warmup_min_ratio_ + ramp_.fraction(it) * (1.0 - warmup_min_ratio_);
    }
    const int64_t real_last_step = it - ramp_.num_steps() + 1;
    const int64_t real_total_steps = std::max<int64_t>(1, total_num_steps_ - ramp_.num_steps());
    const double progress = std::min(
        1.0, static_cast<double>(real_last_step) / static_cast<double>(real_total_steps));
    const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
    return std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * cosine);
  }

  WarmupRamp ramp_;
  double base_lr_;
  int64_t total_num_steps_;
  double warmup_min_ratio_;
  double cos_min_ratio_;
};

// OneCycle: one triangular cycle of lr (min -> max -> min) with momentum moving
// the opposite way (max -> min -> max), optionally in stairs, then an optional
// hyperbolic decay: lr = cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size),
// momentum = cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size).
class OneCycle : public LrScheduler {
 public:
  explicit OneCycle(const SchedulerConfig& c)
      : first_size_(static_cast<double>(c.cycle_first_step_size)),
        second_size_(c.cycle_second_step_size ? static_cast<double>(*c.cycle_second_step_size)
                                              : first_size_),
        total_size_(first_size_ + second_size_),
        step_ratio_(first_size_ / total_size_),
        first_stairs_(c.cycle_first_stair_count),
        second_stairs_(c.cycle_second_stair_count.value_or(c.cycle_first_stair_count)),
        decay_step_size_(c.decay_step_size),
        min_lr_(c.cycle_min_lr),
        max_lr_(c.cycle_max_lr),
        decay_lr_rate_(c.decay_lr_rate),
        cycle_momentum_(c.cycle_momentum),
        min_mom_(c.cycle_min_mom),
        max_mom_(c.cycle_max_mom),
        decay_mom_rate_(c.decay_mom_rate),
        // DeepSpeed tests these with math.isclose(x, 0), which (abs_tol 0) is
        // exact equality with zero.
        skip_lr_decay_(c.decay_step_size == 0 || c.decay_lr_rate == 0.0),
        skip_mom_decay_(c.decay_step_size == 0 || c.decay_mom_rate == 0.0) {}

  double lr() const override {
    const int64_t it = last_batch_iteration_;
    if (static_cast<double>(it) < total_size_) {
      return min_lr_ + (max_lr_ - min_lr_) * scale_factor(it);
    }
    if (skip_lr_decay_) return min_lr_;
    return min_lr_ / (1.0 + decay_lr_rate_ * decay_interval(it));
  }

  std::optional<double> beta1() const override {
    if (!cycle_momentum_) return std::nullopt;
    const int64_t it = last_batch_iteration_;
    // DeepSpeed's constructor writes cycle_min_mom into the optimizer, while
    // its formula at iteration -1 would give cycle_max_mom: the first step
    // really runs with cycle_min_mom, the second with ~cycle_max_mom.
    if (it == -1) return min_mom_;
    if (static_cast<double>(it) < total_size_) {
      return max_mom_ - (max_mom_ - min_mom_) * scale_factor(it);
    }
    if (skip_mom_decay_) return max_mom_;
    return max_mom_ * (1.0 + decay_mom_rate_ * decay_interval(it));
  }

 private:
  // Position in the cycle, 0 at the ends and 1 at the peak, for the batch
  // after `it` (DeepSpeed evaluates at last_batch_iteration + 1).
  double scale_factor(int64_t it) const {
    const int64_t batch = it + 1;
    const double b = static_cast<double>(batch);
    const double cycle = std::floor(1.0 + b / total_size_);
    const double x = 1.0 + b / total_size_ - cycle;
    double scale;
    int64_t stairs;
    if (x <= step_ratio_) {
      scale = x / step_ratio_;
      stairs = first_stairs_;
    } else {
      scale = (x - 1.0) / (step_ratio_ - 1.0);
      stairs = second_stairs_;
    }
    if (stairs > 0) {
      // Quantised from the integer offset in the cycle, not from `scale`, as
      // DeepSpeed does (a float scale just under a stair would drop a stair).
      const double in_cycle = std::fmod(b, total_size_);
      const double n = static_cast<double>(stairs);
      const double position = in_cycle <= first_size_
                                  ? in_cycle * n / first_size_
                                  : (total_size_ - in_cycle) * n / second_size_;
      scale = std::floor(position) / n;
    }
    return scale;
  }

  double decay_interval(int64_t it) const {
    const double decay_iteration = static_cast<double>(it) - total_size_ + 1.0;
    return decay_iteration / static_cast<double>(decay_step_size_);
  }

  double first_size_;
  double second_size_;
  double total_size_;
  double step_ratio_;
  int64_t first_stairs_;
  int64_t second_stairs_;
  int64_t decay_step_size_;
  double min_lr_;
  double max_lr_;
  double decay_lr_rate_;
  bool cycle_momentum_;
  double min_mom_;
  double max_mom_;
  double decay_mom_rate_;
  bool skip_lr_decay_;
  bool skip_mom_decay_;
};

// LRRangeTest: min_lr * (1 + step_rate * (it + 1) / step_size), the interval
// floored in staircase mode.
class LRRangeTest : public LrScheduler {
 public:
  explicit LRRangeTest(const SchedulerConfig& c)
      : min_lr_(c.lr_range_test_min_lr),
        step_size_(c.lr_range_test_step_size),
        step_rate_(c.lr_range_test_step_rate),
        staircase_(c.lr_range_test_staircase) {}

  double lr() const override {
    double interval =
        static_cast<double>(last_batch_iteration_ + 1) / static_cast<double>(step_size_);
    if (staircase_) interval = std::floor(interval);
    return min_lr_ * (1.0 + step_rate_ * interval);
  }

 private:
  double min_lr_;
  int64_t step_size_;
  double step_rate_;
  bool staircase_;
};

}  // namespace

std::unique_ptr<LrScheduler> LrScheduler::create(const config::SchedulerConfig& config,
                                                 double base_lr, double base_beta1) {
  // DeepSpeed's OneCycle never reads the optimizer's betas (it overwrites them
  // with (cycle_min_mom, 0.99)), so base_beta1 takes part in no formula.
  (void)base_beta1;
  std::vector<std::string> problems;
  switch (config.type) {
    case config::SchedulerType::kWarmupLR:
    case config::SchedulerType::kWarmupDecayLR:
    case config::SchedulerType::kWarmupCosineLR:
      check_warmup_num_steps(config, problems);
      break;
    case config::SchedulerType::kOneCycle:
      if (config.cycle_first_step_size <= 0) {
        problems.push_back(param_problem("cycle_first_step_size", "a positive integer",
                                         config.cycle_first_step_size));
      }
      if (config.cycle_second_step_size && *config.cycle_second_step_size < 0) {
        problems.push_back(param_problem("cycle_second_step_size", "a non-negative integer",
                                         *config.cycle_second_step_size));
      }
      break;
    case config::SchedulerType::kLRRangeTest:
      if (config.lr_range_test_step_size <= 0) {
        problems.push_back(param_problem("lr_range_test_step_size", "a positive integer",
                                         config.lr_range_test_step_size));
      }
      break;
  }
  if (!problems.empty()) throw ConfigError(std::move(problems));

  switch (config.type) {
    case config::SchedulerType::kWarmupLR:
      return std::make_unique<WarmupLR>(config, config.warmup_max_lr.value_or(base_lr));
    case config::SchedulerType::kWarmupDecayLR:
      // Not the optimizer's lr: WarmupDecayLR's own signature defaults
      // warmup_max_lr to 0.001, and DeepSpeed passes only the config's params.
      return std::make_unique<WarmupDecayLR>(config, config.warmup_max_lr.value_or(0.001));
    case config::SchedulerType::kWarmupCosineLR:
      return std::make_unique<WarmupCosineLR>(config, base_lr);
    case config::SchedulerType::kOneCycle:
      return std::make_unique<OneCycle>(config);
    case config::SchedulerType::kLRRangeTest:
      return std::make_unique<LRRangeTest>(config);
  }
  ZERO_CHECK(false, "unknown SchedulerType " + std::to_string(static_cast<int>(config.type)));
  return nullptr;
}

}  // namespace zero::optim
