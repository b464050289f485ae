// The batch triangle (rules 2.1-2.3): DeepSpeed's unit-test truth table at
// world size 2, each fill rule, floor division and the >0 / equality checks.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "config_test_util.h"
#include "zero/config/config.h"
#include "zero/core/error.h"

namespace zero::config {
namespace {

using test::joined;
using test::problems_of;
using test::problems_of_file;

struct Given {
  std::optional<int64_t> tbs, mbs, gas;
};

std::string config_text(const Given& g) {
  std::string text = "{";
  auto add = [&](const char* key, const std::optional<int64_t>& v) {
    if (!v) return;
    if (text.size() > 1) text += ", ";
    text += "\"" + std::string(key) + "\": " + std::to_string(*v);
  };
  add("train_batch_size", g.tbs);
  add("train_micro_batch_size_per_gpu", g.mbs);
  add("gradient_accumulation_steps", g.gas);
  return text + "}";
}

struct TriangleCase {
  const char* name;
  int64_t world_size;
  Given given;
  bool ok;
  int64_t tbs, mbs, gas;   // when ok
  const char* mentions;    // when !ok: a substring of some problem
};

class Triangle : public ::testing::TestWithParam<TriangleCase> {};

TEST_P(Triangle, MatchesDeepSpeed) {
  const TriangleCase& c = GetParam();
  const std::string text = config_text(c.given);
  LoadOptions o;
  o.world_size = c.world_size;
  if (c.ok) {
    Config config;
    ASSERT_NO_THROW(config = load_string(text, o)) << text << "\n" << joined(problems_of(text, c.world_size));
    EXPECT_EQ(config.batch.train_batch_size, c.tbs);
    EXPECT_EQ(config.batch.train_micro_batch_size_per_gpu, c.mbs);
    EXPECT_EQ(config.batch.gradient_accumulation_steps, c.gas);
    EXPECT_EQ(config.world_size, c.world_size);
  } else {
    const auto problems = problems_of(text, c.world_size);
    ASSERT_FALSE(problems.empty()) << text;
    EXPECT_NE(joined(problems).find(c.mentions), std::string::npos) << text << "\n" << joined(problems);
  }
}

// tests/unit/runtime/test_ds_config_dict.py::TestBatchConfig, num_ranks 2.
INSTANTIATE_TEST_SUITE_P(
    DeepSpeedUnitTest, Triangle,
    ::testing::Values(
        // (32,16,1) passes as all three, as each pair, and alone (gas 1).
        TriangleCase{"p32_16_1_all", 2, {32, 16, 1}, true, 32, 16, 1, ""},
        TriangleCase{"p32_16_1_tbs_mbs", 2, {32, 16, {}}, true, 32, 16, 1, ""},
        TriangleCase{"p32_16_1_tbs_gas", 2, {32, {}, 1}, true, 32, 16, 1, ""},
        TriangleCase{"p32_16_1_mbs_gas", 2, {{}, 16, 1}, true, 32, 16, 1, ""},
        TriangleCase{"p32_16_1_mbs", 2, {{}, 16, {}}, true, 32, 16, 1, ""},
        TriangleCase{"p32_16_1_tbs", 2, {32, {}, {}}, true, 32, 16, 1, ""},
        // (32,8,2) passes as all three and as each pair.
        TriangleCase{"p32_8_2_all", 2, {32, 8, 2}, true, 32, 8, 2, ""},
        TriangleCase{"p32_8_2_tbs_mbs", 2, {32, 8, {}}, true, 32, 8, 2, ""},
        TriangleCase{"p32_8_2_tbs_gas", 2, {32, {}, 2}, true, 32, 8, 2, ""},
        TriangleCase{"p32_8_2_mbs_gas", 2, {{}, 8, 2}, true, 32, 8, 2, ""},
        // (33,17,2) fails as all three, as tbs+mbs, as tbs+gas; gas alone fails.
        TriangleCase{"f33_17_2_all", 2, {33, 17, 2}, false, 0, 0, 0,
                     "train_batch_size: expected train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                     "world_size = 17 * 2 * 2 = 68; got 33"},
        TriangleCase{"f33_17_2_tbs_mbs", 2, {33, 17, {}}, false, 0, 0, 0,
                     "gradient_accumulation_steps: expected an integer > 0; got 0 (derived: train_batch_size 33 // "
                     "train_micro_batch_size_per_gpu 17 // world_size 2)"},
        TriangleCase{"f33_17_2_tbs_gas", 2, {33, {}, 2}, false, 0, 0, 0, "= 8 * 2 * 2 = 32; got 33"},
        TriangleCase{"f33_17_2_gas", 2, {{}, {}, 2}, false, 0, 0, 0,
                     "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"},
        // (32,18,1) fails as all three and as tbs+mbs.
        TriangleCase{"f32_18_1_all", 2, {32, 18, 1}, false, 0, 0, 0, "= 18 * 1 * 2 = 36; got 32"},
        TriangleCase{"f32_18_1_tbs_mbs", 2, {32, 18, {}}, false, 0, 0, 0,
                     "gradient_accumulation_steps: expected an integer > 0; got 0"},
        TriangleCase{"f32_18_1_gas", 2, {{}, {}, 1}, false, 0, 0, 0, "got neither"}),
    [](const ::testing::TestParamInfo<TriangleCase>& info) { return std::string(info.param.name); });

// Rules 2.1/2.2 rows and examples at other world sizes.
INSTANTIATE_TEST_SUITE_P(
    Rules, Triangle,
    ::testing::Values(
        TriangleCase{"mbs_gas_ws1", 1, {{}, 8, 3}, true, 24, 8, 3, ""},
        TriangleCase{"tbs_mbs_ws4", 4, {256, 16, {}}, true, 256, 16, 4, ""},
        TriangleCase{"tbs_only_ws4", 4, {64, {}, {}}, true, 64, 16, 1, ""},
        TriangleCase{"mbs_only_ws8", 8, {{}, 2, {}}, true, 16, 2, 1, ""},
        TriangleCase{"tbs_gas_ws4", 4, {64, {}, 2}, true, 64, 8, 2, ""},
        TriangleCase{"indivisible_ws3", 3, {256, 16, {}}, false, 0, 0, 0, "= 16 * 5 * 3 = 240; got 256"},
        TriangleCase{"tbs_only_below_ws", 4, {2, {}, {}}, false, 0, 0, 0,
                     "train_micro_batch_size_per_gpu: expected an integer > 0; got 0 (derived: train_batch_size 2 "
                     "// world_size 4)"},
        TriangleCase{"zero_tbs", 1, {0, {}, {}}, false, 0, 0, 0, "train_batch_size: expected an integer > 0; got 0"},
        TriangleCase{"negative_mbs", 1, {{}, -2, {}}, false, 0, 0, 0,
                     "train_micro_batch_size_per_gpu: expected an integer > 0; got -2"},
        TriangleCase{"zero_mbs_divisor", 1, {8, 0, {}}, false, 0, 0, 0,
                     "train_micro_batch_size_per_gpu: expected an integer > 0; got 0"},
        TriangleCase{"zero_gas", 1, {{}, 4, 0}, false, 0, 0, 0,
                     "gradient_accumulation_steps: expected an integer > 0; got 0"},
        TriangleCase{"nothing", 1, {{}, {}, {}}, false, 0, 0, 0, "got neither"}),
    [](const ::testing::TestParamInfo<TriangleCase>& info) { return std::string(info.param.name); });

TEST(Batch, OriginsSayWhatWasDerived) {
  const Config c = load_string(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8})");
  for (const ResolvedValue& r : c.resolved) {
    if (r.path == "train_batch_size") {
      EXPECT_EQ(r.origin, Origin::kGiven);
    }
    if (r.path == "train_micro_batch_size_per_gpu") {
      EXPECT_EQ(r.origin, Origin::kGiven);
    }
    if (r.path == "gradient_accumulation_steps") {
      EXPECT_EQ(r.origin, Origin::kDerived);
      EXPECT_EQ(r.value, "4");
    }
  }
}

TEST(Batch, IntegralFloatsAreIntegers) {
  const Config c = load_string(R"({"train_batch_size": 3.2e1, "gradient_accumulation_steps": 2.0})");
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 16);
}

TEST(Batch, NonIntegralAndNonNumbersAreRejected) {
  const auto problems =
      problems_of(R"({"train_batch_size": 32.5, "train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": true})",
                  1);
  const std::string all = joined(problems);
  EXPECT_NE(all.find("ds.json: train_batch_size: expected an integer; got 32.5"), std::string::npos) << all;
  EXPECT_NE(all.find("ds.json: train_micro_batch_size_per_gpu: expected an integer; got \"8\""), std::string::npos)
      << all;
  EXPECT_NE(all.find("ds.json: gradient_accumulation_steps: expected an integer; got true"), std::string::npos) << all;
  EXPECT_EQ(problems.size(), 3u) << all;
}

TEST(Batch, NullMeansAbsent) {
  const Config c = load_string(R"({"train_batch_size": null, "train_micro_batch_size_per_gpu": 4})");
  EXPECT_EQ(c.batch.train_batch_size, 4);
}

TEST(Batch, WorldSizeMustBePositive) {
  const auto problems = problems_of(R"({"train_batch_size": 8})", 0);
  EXPECT_NE(joined(problems).find("LoadOptions::world_size: expected an integer > 0; got 0"), std::string::npos)
      << joined(problems);
}

}  // namespace
}  // namespace zero::config
