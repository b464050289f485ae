// LR schedules against DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py).
//
// Expected values are written out by hand for each iteration (derived from the
// formulas on paper), not computed through the code under test. `it` is
// DeepSpeed's last_batch_iteration: -1 is a fresh scheduler, i.e. the lr of the
// first optimizer step; the lr of optimizer step k is the value at it = k - 2
// once k >= 2 (step() runs after every applied step).
#include "zero/optim/lr_scheduler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "zero/core/error.h"

namespace zero::optim {
namespace {

using config::SchedulerConfig;
using config::SchedulerType;
using config::WarmupType;

struct Point {
  int64_t it;
  double lr;
};

// DeepSpeed evaluates in a fixed operation order and we keep it; the hand
// formulas here use other orders, so allow a few ulp.
void expect_close(double actual, double expected, const std::string& what) {
  EXPECT_NEAR(actual, expected, 1e-13 + 1e-12 * std::fabs(expected)) << what;
}

// Walks a fresh scheduler forward with step() (as the engine does) and checks
// every listed iteration; also checks that set_last_batch_iteration gives the
// same value (checkpoint restore).
void check_points(const SchedulerConfig& c, double base_lr, const std::vector<Point>& points,
                  const std::string& name) {
  auto s = LrScheduler::create(c, base_lr);
  ASSERT_EQ(s->last_batch_iteration(), -1) << name;
  for (const Point& p : points) {
    ASSERT_GE(p.it, s->last_batch_iteration()) << name << ": points must be in order";
    while (s->last_batch_iteration() < p.it) s->step();
    expect_close(s->lr(), p.lr, name + " at it=" + std::to_string(p.it));
    auto restored = LrScheduler::create(c, base_lr);
    restored->set_last_batch_iteration(p.it);
    EXPECT_EQ(restored->lr(), s->lr()) << name << " restored at it=" << p.it;
  }
}

SchedulerConfig warmup(SchedulerType type, WarmupType wt, int64_t n) {
  SchedulerConfig c;
  c.type = type;
  c.warmup_type = wt;
  c.warmup_num_steps = n;
  return c;
}

TEST(WarmupLR, LogRampReachesMaxOnLastWarmupIteration) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupLR, WarmupType::kLog, 10);
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 0.1;
  const double l10 = std::log(10.0);
  check_points(c, /*base_lr=*/5.0,
               {
                   {-1, 0.0},  // fresh: min_lr (optimizer step 1)
                   {0, 0.0},   // log(1) = 0: optimizer step 2 also at min_lr
                   {1, 0.1 * std::log(2.0) / l10},
                   {4, 0.1 * std::log(5.0) / l10},
                   {8, 0.1 * std::log(9.0) / l10},
                   {9, 0.1},  // log(10)/log(10)
                   {10, 0.1},
                   {1000, 0.1},
               },
               "WarmupLR log");
}

TEST(WarmupLR, LinearRampWithNonZeroMin) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 10);
  c.warmup_min_lr = 0.01;
  c.warmup_max_lr = 0.11;
  check_points(c, 5.0,
               {
                   {-1, 0.01},
                   {0, 0.01},
                   {1, 0.02},
                   {5, 0.06},
                   {9, 0.10},  // linear stops one short of max ...
                   {10, 0.11},  // ... and jumps to it after warmup
                   {11, 0.11},
               },
               "WarmupLR linear");
}

TEST(WarmupLR, UnsetMaxLrUsesOptimizerLr) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 4);
  c.warmup_min_lr = 0.0;
  check_points(c, /*base_lr=*/0.2, {{-1, 0.0}, {2, 0.1}, {4, 0.2}, {50, 0.2}},
               "WarmupLR max unset");
}

TEST(WarmupLR, OneWarmupStepIsTreatedAsTwo) {
  // DeepSpeed: warmup_num_steps = max(2, warmup_num_steps).
  SchedulerConfig c = warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 1);
  c.warmup_max_lr = 1.0;
  check_points(c, 5.0, {{0, 0.0}, {1, 0.5}, {2, 1.0}}, "WarmupLR N=1 linear");
  c.warmup_type = WarmupType::kLog;
  check_points(c, 5.0, {{0, 0.0}, {1, 1.0}, {2, 1.0}}, "WarmupLR N=1 log");
}

TEST(WarmupDecayLR, LinearDecayToZeroAtTotalSteps) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLinear, 10);
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 0.1;
  c.total_num_steps = 30;
  // After warmup: max * (total - it) / (total - N).
  check_points(c, 5.0,
               {
                   {-1, 0.0},
                   {0, 0.0},
                   {9, 0.09},
                   {10, 0.1},
                   {11, 0.1 * 19.0 / 20.0},
                   {20, 0.05},
                   {29, 0.1 / 20.0},
                   {30, 0.0},
                   {45, 0.0},  // clamped at 0, never negative
               },
               "WarmupDecayLR");
}

TEST(WarmupDecayLR, LogWarmupWithMinLrDecaysToMinLr) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLog, 5);
  c.warmup_min_lr = 0.02;
  c.warmup_max_lr = 0.12;
  c.total_num_steps = 15;
  check_points(c, 5.0,
               {
                   {-1, 0.02},
                   {2, 0.02 + 0.1 * std::log(3.0) / std::log(5.0)},
                   {4, 0.12},
                   {5, 0.12},
                   {10, 0.07},
                   {15, 0.02},
                   {16, 0.02},
               },
               "WarmupDecayLR log");
}

TEST(WarmupDecayLR, UnsetMaxLrIsDeepSpeedDefaultNotOptimizerLr) {
  // WarmupDecayLR's signature defaults warmup_max_lr to 0.001; unlike
  // WarmupLR it never reads the optimizer's lr.
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLinear, 2);
  c.total_num_steps = 10;
  check_points(c, /*base_lr=*/0.5, {{2, 0.001}, {6, 0.0005}}, "WarmupDecayLR max unset");
}

TEST(WarmupCosineLR, WarmupThenHalfCosineToFloor) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupCosineLR, WarmupType::kLinear, 10);
  c.total_num_steps = 30;
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.01;
  const double base = 0.1;
  auto cosine = [&](double progress) {
    return base * (0.01 + 0.99 * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0);
  };
  check_points(c, base,
               {
                   {-1, 0.0},  // fresh: 0, so optimizer step 1 does not move the weights
                   {0, 0.01},  // warmup_min_ratio * lr
                   {5, base * (0.1 + 0.5 * 0.9)},
                   {9, base * (0.1 + 0.9 * 0.9)},
                   {10, cosine(1.0 / 20.0)},  // first decay step is already past the peak
                   {19, cosine(0.5)},
                   {29, base * 0.01},
                   {30, base * 0.01},  // clamped: no second half-wave
                   {100, base * 0.01},
               },
               "WarmupCosineLR linear");
}

TEST(WarmupCosineLR, LogWarmupAndShortTotal) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupCosineLR, WarmupType::kLog, 8);
  c.total_num_steps = 4;  // shorter than warmup: floor right after warmup
  c.warmup_min_ratio = 0.0;
  c.cos_min_ratio = 0.05;
  check_points(c, 2.0,
               {{0, 0.0}, {3, 2.0 * std::log(4.0) / std::log(8.0)}, {7, 2.0}, {8, 0.1}, {9, 0.1}},
               "WarmupCosineLR log");
}

SchedulerConfig one_cycle() {
  SchedulerConfig c;
  c.type = SchedulerType::kOneCycle;
  c.cycle_min_lr = 0.01;
  c.cycle_max_lr = 0.11;
  c.cycle_first_step_size = 10;
  c.cycle_min_mom = 0.8;
  c.cycle_max_mom = 0.9;
  return c;
}

struct CyclePoint {
  int64_t it;
  double lr;
  double mom;
};

void check_cycle(const SchedulerConfig& c, const std::vector<CyclePoint>& points,
                 const std::string& name) {
  std::vector<Point> lrs;
  for (const CyclePoint& p : points) lrs.push_back({p.it, p.lr});
  check_points(c, 5.0, lrs, name);
  auto s = LrScheduler::create(c, 5.0);
  for (const CyclePoint& p : points) {
    s->set_last_batch_iteration(p.it);
    ASSERT_TRUE(s->beta1().has_value()) << name;
    expect_close(*s->beta1(), p.mom, name + " beta1 at it=" + std::to_string(p.it));
  }
}

TEST(OneCycle, SymmetricCycleThenHoldAtMin) {
  // Evaluated at batch = it + 1: x = batch / 20, scale = x / 0.5 rising,
  // (x - 1) / (0.5 - 1) falling; lr = min + 0.1 * scale, mom = 0.9 - 0.1 * scale.
  check_cycle(one_cycle(),
              {
                  {-1, 0.01, 0.8},  // fresh: DeepSpeed writes cycle_min_mom, not the formula's 0.9
                  {0, 0.02, 0.89},
                  {4, 0.06, 0.85},
                  {8, 0.10, 0.81},
                  {9, 0.11, 0.80},  // peak at batch == first step size
                  {10, 0.10, 0.81},
                  {18, 0.02, 0.89},
                  {19, 0.01, 0.90},  // batch 20 wraps to the cycle start
                  {20, 0.01, 0.90},  // decay phase, decay disabled
                  {500, 0.01, 0.90},
              },
              "OneCycle symmetric");
}

TEST(OneCycle, AsymmetricCycle) {
  SchedulerConfig c = one_cycle();
  c.cycle_first_step_size = 4;
  c.cycle_second_step_size = 12;  // total 16, step_ratio 0.25
  check_cycle(c,
              {
                  {0, 0.01 + 0.1 * 0.25, 0.9 - 0.1 * 0.25},
                  {3, 0.11, 0.8},
                  {9, 0.06, 0.85},  // x = 10/16: (0.625 - 1) / (0.25 - 1) = 0.5
                  {15, 0.01, 0.9},
              },
              "OneCycle asymmetric");
}

TEST(OneCycle, DecayAfterCycle) {
  SchedulerConfig c = one_cycle();
  c.decay_step_size = 5;
  c.decay_lr_rate = 0.5;
  c.decay_mom_rate = 0.1;
  // k = it - 20 + 1; lr = 0.01 / (1 + 0.5 k / 5); mom = 0.9 (1 + 0.1 k / 5).
  check_cycle(c,
              {
                  {19, 0.01, 0.9},
                  {20, 0.01 / 1.1, 0.9 * 1.02},
                  {24, 0.01 / 1.5, 0.9 * 1.1},
                  {29, 0.01 / 2.0, 0.9 * 1.2},
              },
              "OneCycle decay");
}

TEST(OneCycle, DecayNeedsBothStepSizeAndRate) {
  SchedulerConfig c = one_cycle();
  c.decay_step_size = 5;
  c.decay_lr_rate = 0.0;   // lr decay off
  c.decay_mom_rate = 0.1;  // momentum decay on
  check_cycle(c, {{24, 0.01, 0.9 * 1.1}}, "OneCycle mom-only decay");
  c.decay_step_size = 0;  // both off
  c.decay_lr_rate = 0.5;
  check_cycle(c, {{24, 0.01, 0.9}}, "OneCycle no decay step");
}

TEST(OneCycle, StairCounts) {
  SchedulerConfig c = one_cycle();
  c.cycle_first_stair_count = 2;
  c.cycle_second_stair_count = 5;
  // Rising: floor(batch * 2 / 10) / 2. Falling: floor((20 - batch) * 5 / 10) / 5.
  check_cycle(c,
              {
                  {3, 0.01, 0.9},    // batch 4: stair 0
                  {4, 0.06, 0.85},   // batch 5: stair 1 of 2
                  {8, 0.06, 0.85},   // batch 9: still stair 1
                  {9, 0.11, 0.8},    // batch 10: top
                  {10, 0.09, 0.82},  // batch 11: floor(4.5) / 5
                  {11, 0.09, 0.82},  // batch 12: 4 / 5
                  {12, 0.07, 0.84},  // batch 13: floor(3.5) / 5
                  {19, 0.01, 0.9},
              },
              "OneCycle stairs");
}

TEST(OneCycle, NoMomentumCycle) {
  SchedulerConfig c = one_cycle();
  c.cycle_momentum = false;
  auto s = LrScheduler::create(c, 5.0);
  EXPECT_FALSE(s->beta1().has_value());
  s->step();
  EXPECT_FALSE(s->beta1().has_value());
  expect_close(s->lr(), 0.02, "lr without momentum cycle");
}

TEST(LRRangeTest, ContinuousAndStaircase) {
  SchedulerConfig c;
  c.type = SchedulerType::kLRRangeTest;
  c.lr_range_test_min_lr = 0.001;
  c.lr_range_test_step_size = 10;
  c.lr_range_test_step_rate = 2.0;
  // min * (1 + rate * (it + 1) / size)
  check_points(c, 5.0, {{-1, 0.001}, {0, 0.0012}, {4, 0.002}, {9, 0.003}, {19, 0.005}},
               "LRRangeTest continuous");
  c.lr_range_test_staircase = true;
  check_points(c, 5.0,
               {{-1, 0.001}, {0, 0.001}, {8, 0.001}, {9, 0.003}, {18, 0.003}, {19, 0.005}},
               "LRRangeTest staircase");
}

TEST(LrScheduler, StepAdvancesOneIterationPerAppliedStep) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 4);
  c.warmup_max_lr = 0.4;
  auto s = LrScheduler::create(c, 5.0);
  // lr for optimizer steps 1, 2, 3, ...: DeepSpeed's construction lr, then
  // one step() after each applied step.
  const std::vector<double> per_step = {0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.4};
  for (size_t k = 0; k < per_step.size(); ++k) {
    EXPECT_EQ(s->last_batch_iteration(), static_cast<int64_t>(k) - 1);
    expect_close(s->lr(), per_step[k], "optimizer step " + std::to_string(k + 1));
    s->step();
  }
}

struct BadParam {
  const char* name;
  SchedulerConfig config;
  const char* message;
};

std::vector<BadParam> bad_params() {
  std::vector<BadParam> out;
  for (SchedulerType t : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR,
                          SchedulerType::kWarmupCosineLR}) {
    SchedulerConfig c = warmup(t, WarmupType::kLog, 0);
    c.total_num_steps = 100;
    out.push_back({"warmup zero", c,
                   "scheduler.params.warmup_num_steps: expected a positive integer; got 0"});
    c.warmup_num_steps = -3;
    out.push_back({"warmup negative", c,
                   "scheduler.params.warmup_num_steps: expected a positive integer; got -3"});
  }
  SchedulerConfig oc = one_cycle();
  oc.cycle_first_step_size = 0;
  out.push_back({"first step size", oc,
                 "scheduler.params.cycle_first_step_size: expected a positive integer; got 0"});
  oc = one_cycle();
  oc.cycle_second_step_size = -1;
  out.push_back(
      {"second step size", oc,
       "scheduler.params.cycle_second_step_size: expected a non-negative integer; got -1"});
  SchedulerConfig rt;
  rt.type = SchedulerType::kLRRangeTest;
  rt.lr_range_test_step_size = 0;
  out.push_back({"range test step size", rt,
                 "scheduler.params.lr_range_test_step_size: expected a positive integer; got 0"});
  return out;
}

TEST(LrScheduler, RejectsWhatDeepSpeedRejects) {
  for (const BadParam& b : bad_params()) {
    try {
      LrScheduler::create(b.config, 0.1);
      ADD_FAILURE() << b.name << ": no error";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << b.name;
      ASSERT_EQ(e.problems().size(), 1u) << b.name;
      EXPECT_EQ(e.problems()[0], b.message) << b.name;
    }
  }
}

TEST(LrScheduler, ReportsAllProblemsTogether) {
  SchedulerConfig c = one_cycle();
  c.cycle_first_step_size = -2;
  c.cycle_second_step_size = -4;
  try {
    LrScheduler::create(c, 0.1);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.problems().size(), 2u);
  }
}

TEST(LrScheduler, AcceptsZeroSecondStepSize) {
  // DeepSpeed allows an empty second half: the lr rises and wraps to min.
  SchedulerConfig c = one_cycle();
  c.cycle_second_step_size = 0;
  check_points(c, 5.0, {{0, 0.02}, {8, 0.10}, {9, 0.01}, {10, 0.01}}, "OneCycle second=0");
}

}  // namespace
}  // namespace zero::optim
