// "auto" (the Hugging Face placeholder): filled from AutoValues where the HF
// integration fills it, an error naming the key where DeepSpeed would choke,
// dropped with a warning inside pydantic sections. Also the resolved-value
// listing: origins, canonical JSON and describe().
#include <gtest/gtest.h>

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

const ResolvedValue* find(const Config& c, const std::string& path) {
  for (const ResolvedValue& r : c.resolved) {
    if (r.path == path) return &r;
  }
  return nullptr;
}

LoadOptions with_batch(int64_t mbs, int64_t gas, int64_t world_size = 1) {
  LoadOptions o;
  o.world_size = world_size;
  o.auto_values.train_micro_batch_size_per_gpu = mbs;
  o.auto_values.gradient_accumulation_steps = gas;
  return o;
}

constexpr const char* kAllAutoBatch =
    R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})";

TEST(Auto, UnresolvedTopLevelBatchKeysNameTheKeyAndTheValueToSupply) {
  const auto problems = problems_of(kAllAutoBatch);
  const std::string all = joined(problems);
  EXPECT_NE(all.find("ds.json: train_micro_batch_size_per_gpu: expected an integer; got \"auto\" (the Hugging Face "
                     "placeholder, which AutoValues::train_micro_batch_size_per_gpu fills)"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("ds.json: gradient_accumulation_steps: expected an integer; got \"auto\""), std::string::npos);
  EXPECT_NE(all.find("ds.json: train_batch_size: expected an integer; got \"auto\""), std::string::npos);
}

TEST(Auto, BatchFilledAsHfDoes) {
  const Config c = load_string(kAllAutoBatch, with_batch(4, 8, 2));
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.batch.train_batch_size, 64);  // world * mbs * gas
  EXPECT_EQ(find(c, "train_batch_size")->origin, Origin::kDerived);
  EXPECT_EQ(find(c, "train_micro_batch_size_per_gpu")->origin, Origin::kDerived);
}

TEST(Auto, TrainBatchAutoUsesLiteralGas) {
  // Accelerate's ALST config: gas 1 literal, tbs and mbs "auto".
  const Config c = load_string(
      R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1})",
      with_batch(2, 16, 4));
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.batch.train_batch_size, 8);
}

TEST(Auto, LiteralValuesWinOverAutoValues) {
  const Config c = load_string(R"({"train_micro_batch_size_per_gpu": 3})", with_batch(4, 8));
  EXPECT_EQ(c.batch.train_micro_batch_size_per_gpu, 3);
  EXPECT_EQ(c.batch.train_batch_size, 3);
}

TEST(Auto, GradientClipping) {
  const std::string text = R"({"train_batch_size": 8, "gradient_clipping": "auto"})";
  const auto problems = problems_of(text);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("gradient_clipping: expected a number >= 0; got \"auto\""), std::string::npos);
  EXPECT_NE(problems[0].find("AutoValues::gradient_clipping"), std::string::npos);
  LoadOptions o;
  o.auto_values.gradient_clipping = 0.5;
  const Config c = load_string(text, o);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.5);
  EXPECT_EQ(find(c, "gradient_clipping")->origin, Origin::kDerived);
}

TEST(Auto, TopLevelKeyHfDoesNotFillIsAnError) {
  const auto problems = problems_of(R"({"train_batch_size": 8, "steps_per_print": "auto"})");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0], "ds.json: steps_per_print: expected an integer > 0; got \"auto\" (neither DeepSpeed nor the "
                         "Hugging Face integration fills \"auto\" here)");
}

constexpr const char* kHfOptimizer = R"({"train_batch_size": 8,
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}}})";

TEST(Auto, OptimizerAndSchedulerParamsNameWhatToSupply) {
  const std::string all = joined(problems_of(kHfOptimizer));
  for (const char* text : {"optimizer.params.lr: expected a number >= 0; got \"auto\" (the Hugging Face placeholder, "
                           "which AutoValues::lr fills)",
                           "optimizer.params.betas: expected a list of two numbers in [0, 1); got \"auto\"",
                           "AutoValues::betas", "optimizer.params.eps:", "AutoValues::weight_decay",
                           "scheduler.params.warmup_max_lr: expected a number >= 0; got \"auto\"",
                           "AutoValues::warmup_num_steps", "AutoValues::total_num_steps"}) {
    EXPECT_NE(all.find(text), std::string::npos) << text << "\n" << all;
  }
  // warmup_min_lr is always 0 under HF, so it never needs a value.
  EXPECT_EQ(all.find("warmup_min_lr"), std::string::npos) << all;
}

TEST(Auto, OptimizerAndSchedulerParamsFilled) {
  LoadOptions o;
  o.auto_values.lr = 2e-5;
  o.auto_values.betas = std::array<double, 2>{0.9, 0.95};
  o.auto_values.eps = 1e-6;
  o.auto_values.weight_decay = 0.1;
  o.auto_values.warmup_num_steps = 50;
  o.auto_values.total_num_steps = 500;
  const Config c = load_string(kHfOptimizer, o);
  ASSERT_TRUE(c.optimizer && c.scheduler);
  EXPECT_DOUBLE_EQ(c.optimizer->lr, 2e-5);
  EXPECT_DOUBLE_EQ(c.optimizer->betas[1], 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer->eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer->weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c.scheduler->warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler->warmup_max_lr, 2e-5);
  EXPECT_EQ(c.scheduler->warmup_num_steps, 50);
  EXPECT_EQ(c.scheduler->total_num_steps, 500);
  EXPECT_EQ(find(c, "optimizer.params.lr")->origin, Origin::kDerived);
  EXPECT_EQ(find(c, "scheduler.params.warmup_max_lr")->origin, Origin::kDerived);
}

constexpr const char* kHiddenAuto = R"({"train_batch_size": 8, "zero_optimization": {"stage": STAGE,
  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})";

std::string hidden_config(int stage) {
  std::string text = kHiddenAuto;
  text.replace(text.find("STAGE"), 5, std::to_string(stage));
  return text;
}

TEST(Auto, HiddenSizeFillsBucketsAndThresholdsAtStage3) {
  LoadOptions o;
  o.auto_values.hidden_size = 4096;
  const Config c = load_string(hidden_config(3), o);
  EXPECT_EQ(c.zero.reduce_bucket_size, 4096 * 4096);
  EXPECT_EQ(c.zero.prefetch_bucket_size, static_cast<int64_t>(0.9 * 4096 * 4096));
  EXPECT_EQ(c.zero.prefetch_bucket_size, 15099494);
  EXPECT_EQ(c.zero.param_persistence_threshold, 40960);
  EXPECT_EQ(find(c, "zero_optimization.reduce_bucket_size")->origin, Origin::kDerived);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
}

TEST(Auto, HiddenSizeStage3KeysAreNotFilledBelowStage3) {
  LoadOptions o;
  o.auto_values.hidden_size = 4096;
  const Config c = load_string(hidden_config(2), o);
  EXPECT_EQ(c.zero.reduce_bucket_size, 4096 * 4096);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 50000000);  // dropped: the default
  EXPECT_EQ(c.zero.param_persistence_threshold, 100000);
  EXPECT_EQ(find(c, "zero_optimization.stage3_prefetch_bucket_size")->origin, Origin::kDefault);
}

TEST(Auto, UnresolvedInPydanticSectionsIsDroppedWithAWarning) {
  const Config c = load_string(hidden_config(3));
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.param_persistence_threshold, 100000);
  EXPECT_EQ(find(c, "zero_optimization.reduce_bucket_size")->origin, Origin::kDefault);
  ASSERT_EQ(c.warnings.size(), 3u) << joined(c.warnings);
  EXPECT_EQ(c.warnings[0], "<string>: zero_optimization.reduce_bucket_size: \"auto\" is not resolved, so it is dropped "
                           "as DeepSpeed does; using the default 500000000 (AutoValues::hidden_size would fill it)");
}

TEST(Auto, NonHfKeyInPydanticSectionIsDropped) {
  LoadOptions o;
  o.auto_values.hidden_size = 1024;
  const Config c = load_string(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "stage3_max_live_parameters": "auto", "offload_param": {"device": "cpu", "buffer_size": "auto"}}})",
                               o);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000);
  EXPECT_EQ(c.warnings.size(), 2u) << joined(c.warnings);
}

TEST(Auto, PrecisionFillsEnabled) {
  const std::string text = R"({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})";
  for (const char* precision : {"fp16", "bf16", "fp32"}) {
    LoadOptions o;
    o.auto_values.precision = precision;
    const Config c = load_string(text, o);
    EXPECT_EQ(c.fp16.enabled, std::string(precision) == "fp16") << precision;
    EXPECT_EQ(c.bf16.enabled, std::string(precision) == "bf16") << precision;
    EXPECT_EQ(find(c, "bf16.enabled")->origin, Origin::kDerived);
  }
  LoadOptions bad;
  bad.auto_values.precision = "int8";
  EXPECT_NE(joined(problems_of(text, bad)).find("AutoValues::precision: expected one of fp32, fp16, bf16"),
            std::string::npos);
}

// ------------------------------------------------------------ resolved values

TEST(Resolved, EveryValueHasOneEntryWithItsOrigin) {
  const Config c = load_string(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
      "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}})");
  const ResolvedValue* stage = find(c, "zero_optimization.stage");
  ASSERT_NE(stage, nullptr);
  EXPECT_EQ(stage->value, "3");
  EXPECT_EQ(stage->origin, Origin::kGiven);
  EXPECT_EQ(find(c, "zero_optimization.reduce_bucket_size")->value, "500000000");
  EXPECT_EQ(find(c, "zero_optimization.overlap_comm")->origin, Origin::kDerived);
  EXPECT_EQ(find(c, "zero_optimization.contiguous_gradients")->origin, Origin::kDefault);
  EXPECT_EQ(find(c, "train_batch_size")->origin, Origin::kDerived);
  EXPECT_EQ(find(c, "zero_optimization.offload_param.device")->value, "\"none\"");
  EXPECT_EQ(find(c, "optimizer")->value, "null");
  for (size_t i = 0; i < c.resolved.size(); ++i) {
    for (size_t j = i + 1; j < c.resolved.size(); ++j) EXPECT_NE(c.resolved[i].path, c.resolved[j].path);
  }
}

TEST(Resolved, CanonicalJsonIsTheSameForTheSameConfig) {
  const Config a = load_string(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
      "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}, "bf16": {"enabled": true}})");
  const Config b = load_string(R"(
    // the same config, written differently
    {"bfloat16": {"enabled": true},
     "zero_optimization": {"max_live_parameters": 1000000000, "stage": 3, "overlap_comm": true},
     "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8,})");
  EXPECT_EQ(a.canonical_json, b.canonical_json);
  EXPECT_EQ(a.canonical_json.find(' '), std::string::npos);
  EXPECT_EQ(a.canonical_json.rfind("{\"activation_checkpointing\":", 0), 0u) << a.canonical_json.substr(0, 80);
  const Config c = load_string(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
      "zero_optimization": {"stage": 2}, "bf16": {"enabled": true}})");
  EXPECT_NE(a.canonical_json, c.canonical_json);
}

TEST(Describe, AlignedColumnsThenWarnings) {
  const Config c = load_string(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": true}})");
  const std::string text = describe(c);
  EXPECT_NE(text.find("zero_optimization.stage"), std::string::npos);
  EXPECT_NE(text.find("(given)\n"), std::string::npos);
  EXPECT_NE(text.find("(default)\n"), std::string::npos);
  EXPECT_NE(text.find("(derived)\n"), std::string::npos);
  const size_t warnings = text.find("warnings:\n");
  ASSERT_NE(warnings, std::string::npos);
  EXPECT_NE(text.find("  <string>: zero_optimization.cpu_offload: deprecated", warnings), std::string::npos) << text;
  // The value column starts at the same offset on every value line.
  size_t column = std::string::npos;
  size_t start = 0;
  for (const ResolvedValue& r : c.resolved) {
    const size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end - start);
    ASSERT_EQ(line.rfind(r.path, 0), 0u) << line;
    const size_t value_at = line.find(r.value, r.path.size());
    if (column == std::string::npos) column = value_at;
    EXPECT_EQ(value_at, column) << line;
    start = end + 1;
  }
  EXPECT_EQ(describe(load_string(R"({"train_batch_size": 8})")).find("warnings: none"),
            describe(load_string(R"({"train_batch_size": 8})")).size() - 15);
}

TEST(ToString, Names) {
  EXPECT_STREQ(to_string(OffloadDevice::kNvme), "nvme");
  EXPECT_STREQ(to_string(OffloadDevice::kCpu), "cpu");
  EXPECT_STREQ(to_string(OffloadDevice::kNone), "none");
  EXPECT_STREQ(to_string(Origin::kGiven), "given");
  EXPECT_STREQ(to_string(Origin::kDerived), "derived");
  EXPECT_STREQ(to_string(Origin::kDefault), "default");
}

}  // namespace
}  // namespace zero::config
