// Loss scaler state machine against DeepSpeed's DynamicLossScaler
// (deepspeed/runtime/fp16/loss_scaler.py), as built by ZeRO from the fp16
// section. Each case is a sequence of step outcomes with the scale expected
// after each, worked out by hand from DeepSpeed's update_scale.
#include "zero/optim/loss_scaler.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "zero/core/error.h"

namespace zero::optim {
namespace {

config::Fp16Config dynamic_fp16(int64_t power, int64_t window, int64_t hysteresis,
                                double min_scale = 1.0, bool consecutive = false) {
  config::Fp16Config f;
  f.enabled = true;
  f.loss_scale = 0.0;
  f.initial_scale_power = power;
  f.loss_scale_window = window;
  f.hysteresis = hysteresis;
  f.min_loss_scale = min_scale;
  f.consecutive_hysteresis = consecutive;
  return f;
}

constexpr bool O = true;   // overflow (step skipped)
constexpr bool C = false;  // clean step

struct Case {
  const char* name;
  config::Fp16Config fp16;
  std::vector<bool> outcomes;
  std::vector<double> scale_after;  // scale after each outcome
};

std::vector<Case> cases() {
  return {
      // Hysteresis 2: the first overflow only uses up hysteresis; the second
      // halves. It is not refilled by a clean step, so the third halves too.
      {"hysteresis delays the first halving", dynamic_fp16(10, 1000, 2),
       {O, O, C, O},
       {1024, 512, 512, 256}},
      // Hysteresis 1: every overflow halves.
      {"no hysteresis", dynamic_fp16(10, 1000, 1), {O, O, O}, {512, 256, 128}},
      // From the start (last overflow -1), the scale doubles on the clean
      // update where cur_iter == window, i.e. the (window + 1)th clean step,
      // and then every window clean steps.
      {"window doubles from the start", dynamic_fp16(4, 3, 2),
       {C, C, C, C, C, C, C},
       {16, 16, 16, 32, 32, 32, 64}},
      // After an overflow at iter 0 the stable interval counts from iter 1:
      // doubling at iter 0 + 1 + window = 3.
      {"window after an overflow", dynamic_fp16(4, 2, 1),
       {O, C, C, C, C, C},
       {8, 8, 8, 16, 16, 32}},
      // The doubling also refills hysteresis: after it, one overflow is absorbed.
      {"window refills hysteresis", dynamic_fp16(6, 2, 2),
       {O, O, C, C, C, O, O},
       {64, 32, 32, 32, 64, 64, 32}},
      // consecutive_hysteresis: every clean step refills it, so isolated
      // overflows never halve.
      {"consecutive hysteresis", dynamic_fp16(6, 1000, 2, 1.0, true),
       {O, C, O, C, O, O},
       {64, 64, 64, 64, 64, 32}},
      // Floor: halving stops at min_loss_scale (4 / 2 = 2 < 3).
      {"min scale floor", dynamic_fp16(2, 1000, 1, 3.0), {O}, {3}},
  };
}

TEST(DynamicLossScaler, Sequences) {
  for (const Case& c : cases()) {
    LossScaler s(c.fp16);
    ASSERT_TRUE(s.dynamic()) << c.name;
    ASSERT_EQ(c.outcomes.size(), c.scale_after.size()) << c.name;
    for (size_t i = 0; i < c.outcomes.size(); ++i) {
      s.update(c.outcomes[i]);
      EXPECT_EQ(s.scale(), c.scale_after[i]) << c.name << " after outcome " << i;
    }
  }
}

TEST(DynamicLossScaler, InitialScaleIsTwoToThePower) {
  config::Fp16Config f;
  f.enabled = true;  // DeepSpeed defaults otherwise: power 16, window 1000, hysteresis 2
  LossScaler s(f);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  const LossScaler::State st = s.state();
  EXPECT_EQ(st.cur_iter, 0);
  EXPECT_EQ(st.last_overflow_iter, -1);
  EXPECT_EQ(st.cur_hysteresis, 2);
}

std::string overflow_at_min_message(LossScaler& s) {
  try {
    s.update(true);
  } catch (const DivergedError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDiverged);
    return e.what();
  }
  return "";
}

TEST(DynamicLossScaler, OverflowAtMinScaleIsAnError) {
  LossScaler s(dynamic_fp16(1, 1000, 1));
  s.update(true);
  EXPECT_EQ(s.scale(), 1.0);
  const LossScaler::State before = s.state();
  const std::string msg = overflow_at_min_message(s);
  ASSERT_FALSE(msg.empty()) << "no error at the minimum scale";
  EXPECT_NE(msg.find("fp16.min_loss_scale=1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("diverged"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bf16"), std::string::npos) << msg;
  // Nothing changed (DeepSpeed raises before updating).
  const LossScaler::State after = s.state();
  EXPECT_EQ(after.cur_scale, before.cur_scale);
  EXPECT_EQ(after.cur_iter, before.cur_iter);
  EXPECT_EQ(after.cur_hysteresis, before.cur_hysteresis);
}

TEST(DynamicLossScaler, HysteresisAbsorbsOneOverflowAtMinScale) {
  LossScaler s(dynamic_fp16(0, 1000, 2, 1.0));  // starts at the minimum
  EXPECT_NO_THROW(s.update(true));             // uses up hysteresis
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_FALSE(overflow_at_min_message(s).empty());
}

TEST(DynamicLossScaler, FloorNotAPowerOfTwoThenError) {
  LossScaler s(dynamic_fp16(2, 1000, 1, 3.0));
  s.update(true);  // 4 -> 3
  const std::string msg = overflow_at_min_message(s);
  EXPECT_NE(msg.find("fp16.min_loss_scale=3"), std::string::npos) << msg;
}

TEST(DynamicLossScaler, StateRoundTrip) {
  LossScaler a(dynamic_fp16(8, 3, 2));
  for (bool o : {O, C, O, C, C}) a.update(o);
  LossScaler b(dynamic_fp16(8, 3, 2));
  b.load_state(a.state());
  for (bool o : {C, C, O, O, C, C, C, C}) {
    a.update(o);
    b.update(o);
    EXPECT_EQ(a.scale(), b.scale());
  }
  EXPECT_EQ(a.state().cur_iter, b.state().cur_iter);
  EXPECT_EQ(a.state().last_overflow_iter, b.state().last_overflow_iter);
  EXPECT_EQ(a.state().cur_hysteresis, b.state().cur_hysteresis);
}

TEST(DynamicLossScaler, RejectsZeroWindowAndNonPositiveMin) {
  try {
    LossScaler s(dynamic_fp16(16, 0, 2, 0.0));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.problems().size(), 2u);
    EXPECT_NE(e.problems()[0].find("fp16.loss_scale_window"), std::string::npos);
    EXPECT_NE(e.problems()[1].find("fp16.min_loss_scale"), std::string::npos);
  }
}

TEST(StaticLossScaler, NeverChanges) {
  config::Fp16Config f;
  f.enabled = true;
  f.loss_scale = 128.0;
  f.loss_scale_window = 0;  // unused by a static scaler, not an error
  LossScaler s(f);
  EXPECT_FALSE(s.dynamic());
  for (bool o : {O, O, O, C, C, C, C, O}) {
    s.update(o);
    EXPECT_EQ(s.scale(), 128.0);
  }
}

TEST(StaticLossScaler, NoFp16MeansScaleOne) {
  LossScaler plain;
  EXPECT_FALSE(plain.dynamic());
  EXPECT_EQ(plain.scale(), 1.0);
  plain.update(true);
  EXPECT_EQ(plain.scale(), 1.0);

  config::Fp16Config disabled = dynamic_fp16(16, 1000, 2);
  disabled.enabled = false;  // e.g. bf16 run: DeepSpeed does not scale
  LossScaler s(disabled);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 1.0);
}

}  // namespace
}  // namespace zero::optim
