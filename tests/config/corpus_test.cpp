// Every real-world config of tests/config/ds_configs/ (see INDEX.md there)
// gives the outcome INDEX.md states for DeepSpeed at world size 1, or names
// the unimplemented feature that makes zero refuse it.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
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

const std::string kCorpus = std::string(ZERO_SOURCE_DIR) + "/tests/config/ds_configs/";

enum class Outcome {
  kOk,           // loads with the given triangle, no AutoValues needed
  kNeedsHf,      // fails naming an "auto" key without AutoValues, loads with them
  kReject,       // DeepSpeed refuses it: the problems name the key
  kUnsupported,  // zero refuses it (with or without AutoValues), naming the feature
};

struct CorpusCase {
  const char* file;
  Outcome outcome;
  int64_t tbs, mbs, gas;               // kOk / kNeedsHf (with the AutoValues below)
  std::vector<std::string> mentions;  // substrings the problems must contain (each in some problem)
};

// What the HF Trainer would supply: per-device batch 4, accumulation 2, bf16.
AutoValues hf_values() {
  AutoValues av;
  av.train_micro_batch_size_per_gpu = 4;
  av.gradient_accumulation_steps = 2;
  av.gradient_clipping = 1.0;
  av.lr = 3e-5;
  av.betas = std::array<double, 2>{0.9, 0.98};
  av.eps = 1e-6;
  av.weight_decay = 0.01;
  av.total_num_steps = 1000;
  av.warmup_num_steps = 100;
  av.precision = "bf16";
  av.hidden_size = 1024;
  return av;
}

const std::vector<CorpusCase>& cases() {
  static const std::vector<CorpusCase> kCases = {
      {"01_hf_transformers_zero2_auto_fp16_bf16.json", Outcome::kNeedsHf, 8, 4, 2, {"train_micro_batch_size_per_gpu"}},
      {"03_hf_transformers_zero3_bfloat16_legacy_key.json", Outcome::kNeedsHf, 8, 4, 2, {"\"auto\""}},
      {"05_accelerate_zero3_offload_gather16bit_auto.json", Outcome::kNeedsHf, 4, 4, 1, {"optimizer.params.lr"}},
      {"07_accelerate_alst_seq_parallel_comm_dtype.json", Outcome::kNeedsHf, 4, 4, 1,
       {"train_micro_batch_size_per_gpu", "AutoValues::train_micro_batch_size_per_gpu"}},
      {"09_llamafactory_z2_autotp_comment_key.json", Outcome::kUnsupported, 0, 0, 0,
       {"tensor_parallel.autotp_size", "not implemented by zero"}},
      {"11_axolotl_zero3_bf16_cpuoffload_all_unprefixed.json", Outcome::kNeedsHf, 8, 4, 2, {"gradient_clipping"}},
      {"13_fastchat_s2_minimal_auto.json", Outcome::kNeedsHf, 8, 4, 2, {"gradient_accumulation_steps"}},
      {"15_llava_zero3_offload_fp16auto_bf16true.json", Outcome::kNeedsHf, 8, 4, 2, {"optimizer.params.betas"}},
      {"18_dsexamples_bert_onebitadam.json", Outcome::kUnsupported, 0, 0, 0,
       {"optimizer.type: \"OneBitAdam\" is not implemented by zero; implemented: Adam, AdamW, Adagrad, Lion"}},
      {"19_dsexamples_bert_onebitlamb.json", Outcome::kUnsupported, 0, 0, 0,
       {"optimizer.type: \"OneBitLamb\" is not implemented by zero"}},
      {"21_dsexamples_bert_lamb_sparse_attention.json", Outcome::kUnsupported, 0, 0, 0,
       {"optimizer.type: \"Lamb\" is not implemented by zero", "sparse_attention: sparse attention is not implemented"}},
      {"23_dsexamples_imagenet_fp16_z1_tabs_unknown_key.json", Outcome::kOk, 256, 256, 1, {}},
      {"25_dsexamples_zenflow_zero2_offload.json", Outcome::kUnsupported, 0, 0, 0,
       {"zero_optimization.zenflow: ZenFlow is not implemented by zero"}},
      {"27_dsexamples_autosp_clipping_auto_compile.json", Outcome::kUnsupported, 0, 0, 0,
       {"compile.deepcompile", "sequence_parallel_size: sequence parallelism is not implemented"}},
      {"29_dsexamples_tp_hf_warmupdecay_autotp.json", Outcome::kUnsupported, 0, 0, 0,
       {"tensor_parallel.autotp_size", "got 4"}},
      {"31_dsexamples_old_zero_infinity_nvme_typo_key.json", Outcome::kReject, 0, 0, 0,
       {"zero_optimization.stage3_param_persitence_threshold: unknown key; did you mean "
        "stage3_param_persistence_threshold?"}},
      {"33_dsexamples_old_zero3_device_None_typo_key.json", Outcome::kReject, 0, 0, 0,
       {"zero_optimization.offload_optimizer.device: expected one of none, cpu, nvme; got \"None\"",
        "zero_optimization.offload_param.device: expected one of none, cpu, nvme; got \"None\"",
        "stage3_param_persitence_threshold: unknown key; did you mean"}},
      {"35_deepspeed_megatron_gpt2_zero0_micro_gas.json", Outcome::kOk, 24, 8, 3, {}},
      {"37_deepspeed_megatron_gpt2_scheduler_no_optimizer.json", Outcome::kOk, 4, 4, 1, {}},
      {"39_deepspeed_torch_compile_deepcompile_z3.json", Outcome::kUnsupported, 0, 0, 0,
       {"compile.deepcompile: DeepCompile is not implemented by zero"}},
      {"41_deepspeed_autotuning_template_zero3_partial.json", Outcome::kReject, 0, 0, 0,
       {"Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"}},
      {"43_megatron_ds_universal_ckpt_data_types.json", Outcome::kOk, 16, 16, 1, {}},
      {"45_bigscience_curriculum_learning_legacy.json", Outcome::kUnsupported, 0, 0, 0,
       {"curriculum_learning.enabled: curriculum learning is not implemented by zero"}},
      {"47_deepspeed_docs_zero3_offload_legacy_cpu_offload_params_crlf.json", Outcome::kReject, 0, 0, 0,
       {"zero_optimization.cpu_offload_params: unknown key; did you mean cpu_offload_param?",
        "zero_optimization.stage3_param_persitance_threshold: unknown key; did you mean "
        "stage3_param_persistence_threshold?",
        "train_batch_size: expected train_batch_size or train_micro_batch_size_per_gpu"}},
      {"49_invalid_deepspeed_unittest_elasticity_with_batch_info_from_pydict.json", Outcome::kUnsupported, 0, 0, 0,
       {"elasticity.enabled: elastic training is not implemented by zero", "\"Lamb\" is not implemented"}},
      {"51_invalid_megatron_ds_offload_pp_template_placeholders.json", Outcome::kReject, 0, 0, 0,
       {"line 2, column 24", "train_batch_size", "bare word CONFIG_BATCH_SIZE"}},
      {"53_invalid_deepspeed_unittest_duplicate_key_trailing_comma.json", Outcome::kReject, 0, 0, 0,
       {"53_invalid_deepspeed_unittest_duplicate_key_trailing_comma.json: train_batch_size: duplicate key"}},
  };
  return kCases;
}

void expect_mentions(const std::vector<std::string>& problems, const std::vector<std::string>& mentions) {
  for (const std::string& m : mentions) {
    bool found = false;
    for (const std::string& p : problems) found = found || p.find(m) != std::string::npos;
    EXPECT_TRUE(found) << "no problem mentions: " << m << "\nproblems:\n" << joined(problems);
  }
}

class Corpus : public ::testing::TestWithParam<CorpusCase> {};

TEST_P(Corpus, GivesTheIndexedOutcome) {
  const CorpusCase& c = GetParam();
  const std::string path = kCorpus + c.file;
  LoadOptions plain;
  LoadOptions hf;
  hf.auto_values = hf_values();
  switch (c.outcome) {
    case Outcome::kOk: {
      const Config config = load_file(path, plain);
      EXPECT_EQ(config.batch.train_batch_size, c.tbs);
      EXPECT_EQ(config.batch.train_micro_batch_size_per_gpu, c.mbs);
      EXPECT_EQ(config.batch.gradient_accumulation_steps, c.gas);
      EXPECT_EQ(config.source, path);
      break;
    }
    case Outcome::kNeedsHf: {
      const std::vector<std::string> problems = problems_of_file(path, plain);
      ASSERT_FALSE(problems.empty()) << "an unresolved \"auto\" must be an error";
      expect_mentions(problems, c.mentions);
      expect_mentions(problems, {"got \"auto\"", "AutoValues::"});
      Config config;
      ASSERT_NO_THROW(config = load_file(path, hf)) << joined(problems_of_file(path, hf));
      EXPECT_EQ(config.batch.train_batch_size, c.tbs);
      EXPECT_EQ(config.batch.train_micro_batch_size_per_gpu, c.mbs);
      EXPECT_EQ(config.batch.gradient_accumulation_steps, c.gas);
      break;
    }
    case Outcome::kReject: {
      const std::vector<std::string> problems = problems_of_file(path, plain);
      ASSERT_FALSE(problems.empty());
      expect_mentions(problems, c.mentions);
      break;
    }
    case Outcome::kUnsupported: {
      for (const LoadOptions& options : {plain, hf}) {
        const std::vector<std::string> problems = problems_of_file(path, options);
        ASSERT_FALSE(problems.empty());
        expect_mentions(problems, c.mentions);
      }
      break;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DsConfigs, Corpus, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<CorpusCase>& info) {
                           return "n" + std::string(info.param.file).substr(0, 2);
                         });

TEST(CorpusIndex, EveryFileHasACase) {
  std::set<std::string> listed;
  for (const CorpusCase& c : cases()) listed.insert(c.file);
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kCorpus)) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    EXPECT_EQ(listed.count(entry.path().filename().string()), 1u) << entry.path();
  }
  EXPECT_EQ(files, listed.size());
}

// Details INDEX.md calls out, beyond the outcome.
TEST(CorpusDetails, HfZero3LegacyBfloat16KeepsBf16OffAndFillsHiddenSizes) {
  LoadOptions options;
  options.auto_values = hf_values();
  const Config c = load_file(kCorpus + "03_hf_transformers_zero3_bfloat16_legacy_key.json", options);
  EXPECT_FALSE(c.bf16.enabled);  // HF fills bf16.enabled only; bfloat16's "auto" is dropped
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.reduce_bucket_size, 1024 * 1024);
  EXPECT_EQ(c.zero.prefetch_bucket_size, static_cast<int64_t>(0.9 * 1024 * 1024));
  EXPECT_EQ(c.zero.param_persistence_threshold, 10240);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000);
  EXPECT_TRUE(c.zero.gather_16bit_weights_on_model_save);  // from the deprecated fp16 spelling
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  ASSERT_TRUE(c.optimizer.has_value());
  EXPECT_EQ(c.optimizer->type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer->lr, 3e-5);
  EXPECT_DOUBLE_EQ(c.optimizer->betas[1], 0.98);
  ASSERT_TRUE(c.scheduler.has_value());
  EXPECT_DOUBLE_EQ(c.scheduler->warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler->warmup_max_lr, 3e-5);
  EXPECT_EQ(c.scheduler->warmup_num_steps, 100);
  const std::string warnings = [&] {
    std::string w;
    for (const std::string& s : c.warnings) w += s + "\n";
    return w;
  }();
  EXPECT_NE(warnings.find("bfloat16: legacy name of bf16"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("bfloat16.enabled: \"auto\" is not resolved"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("stage3_gather_fp16_weights_on_model_save: deprecated"), std::string::npos) << warnings;
}

TEST(CorpusDetails, LlavaFp16AutoWithBf16FromPrecision) {
  LoadOptions options;
  options.auto_values = hf_values();
  const Config c = load_file(kCorpus + "15_llava_zero3_offload_fp16auto_bf16true.json", options);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(c.steps_per_print, 100000);  // 1e5 is an integral float
  EXPECT_TRUE(c.zero.gather_16bit_weights_on_model_save);
  EXPECT_TRUE(c.zero.overlap_comm);
}

TEST(CorpusDetails, AccelerateGather16bitAutoIsDroppedWithAWarning) {
  LoadOptions options;
  options.auto_values = hf_values();
  const Config c = load_file(kCorpus + "05_accelerate_zero3_offload_gather16bit_auto.json", options);
  EXPECT_FALSE(c.zero.gather_16bit_weights_on_model_save);
  EXPECT_TRUE(c.fp16.enabled);
  ASSERT_TRUE(c.scheduler.has_value());
  EXPECT_EQ(c.scheduler->type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(c.scheduler->total_num_steps, 1000);
  bool warned = false;
  for (const std::string& w : c.warnings) {
    warned = warned || w.find("stage3_gather_16bit_weights_on_model_save: \"auto\"") != std::string::npos;
  }
  EXPECT_TRUE(warned);
}

TEST(CorpusDetails, ImagenetTabsUnknownKeyClippingZero) {
  const Config c = load_file(kCorpus + "23_dsexamples_imagenet_fp16_z1_tabs_unknown_key.json");
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.0);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_TRUE(c.fp16.auto_cast);
  EXPECT_EQ(c.zero.stage, 1);
  ASSERT_TRUE(c.optimizer.has_value());
  EXPECT_EQ(c.optimizer->type, OptimizerType::kAdam);
  EXPECT_TRUE(c.optimizer->adam_w_mode);
  EXPECT_DOUBLE_EQ(c.optimizer->betas[0], 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer->weight_decay, 3e-7);
  // The unknown key is named (not an error: DeepSpeed ignores it too).
  bool named = false;
  for (const std::string& w : c.warnings) named |= w.find("cuda_visible_devices: unknown top-level key") != std::string::npos;
  EXPECT_TRUE(named);
}

TEST(CorpusDetails, UniversalCheckpointDataTypesAndWorldSize2) {
  const std::string path = kCorpus + "43_megatron_ds_universal_ckpt_data_types.json";
  const Config c = load_file(path);
  EXPECT_EQ(c.grad_accum_dtype, "fp32");
  EXPECT_TRUE(c.bf16.enabled);
  LoadOptions ws2;
  ws2.world_size = 2;
  const std::vector<std::string> problems = problems_of_file(path, ws2);
  expect_mentions(problems, {"gradient_accumulation_steps: expected an integer > 0; got 0"});
}

TEST(CorpusDetails, MegatronZero0KeepsStage2Keys) {
  const Config c = load_file(kCorpus + "35_deepspeed_megatron_gpt2_zero0_micro_gas.json");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.zero.reduce_bucket_size, 7000000);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_TRUE(c.activation_checkpointing.partition_activations);
}

TEST(CorpusDetails, SchedulerWithoutOptimizer) {
  const Config c = load_file(kCorpus + "37_deepspeed_megatron_gpt2_scheduler_no_optimizer.json");
  EXPECT_FALSE(c.optimizer.has_value());
  ASSERT_TRUE(c.scheduler.has_value());
  EXPECT_EQ(c.scheduler->warmup_max_lr, 0.001);
  EXPECT_EQ(c.scheduler->warmup_num_steps, 10);
}

}  // namespace
}  // namespace zero::config
