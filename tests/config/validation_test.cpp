// Validation of every section: types and coercions, enums, ranges, unknown
// keys, deprecated keys and aliases, precision, optimizer, scheduler and the
// unsupported-feature table.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
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

// A valid base to add one section to.
std::string with(const std::string& body) { return "{\"train_batch_size\": 8, " + body + "}"; }

bool has_warning(const Config& c, const std::string& text) {
  for (const std::string& w : c.warnings) {
    if (w.find(text) != std::string::npos) return true;
  }
  return false;
}

// ------------------------------------------------------------ rejections

struct BadCase {
  const char* name;
  std::string body;      // inside with(...)
  std::string problem;   // expected as a substring of exactly one problem line
};

class Rejects : public ::testing::TestWithParam<BadCase> {};

TEST_P(Rejects, WithAMessageNamingTheKey) {
  const auto problems = problems_of(with(GetParam().body));
  ASSERT_FALSE(problems.empty()) << GetParam().body;
  int matches = 0;
  for (const std::string& p : problems) matches += p.find(GetParam().problem) != std::string::npos ? 1 : 0;
  EXPECT_EQ(matches, 1) << "looking for: " << GetParam().problem << "\nin:\n" << joined(problems);
}

INSTANTIATE_TEST_SUITE_P(
    Sections, Rejects,
    ::testing::Values(
        // zero_optimization
        BadCase{"stage4", R"("zero_optimization": {"stage": 4})",
                "ds.json: zero_optimization.stage: expected an integer in [0, 3]; got 4"},
        BadCase{"stage_fraction", R"("zero_optimization": {"stage": 1.5})",
                "zero_optimization.stage: expected an integer in [0, 3]; got 1.5"},
        BadCase{"bucket_fraction", R"("zero_optimization": {"reduce_bucket_size": 2.5})",
                "zero_optimization.reduce_bucket_size: expected an integer >= 0; got 2.5"},
        BadCase{"bucket_negative", R"("zero_optimization": {"allgather_bucket_size": -1})",
                "zero_optimization.allgather_bucket_size: expected an integer >= 0; got -1"},
        BadCase{"bool_as_int", R"("zero_optimization": {"contiguous_gradients": 1})",
                "zero_optimization.contiguous_gradients: expected true or false; got 1"},
        BadCase{"bool_as_string", R"("zero_optimization": {"overlap_comm": "true"})",
                "zero_optimization.overlap_comm: expected true or false; got \"true\""},
        BadCase{"null_in_strict", R"("zero_optimization": {"stage": null})",
                "zero_optimization.stage: expected an integer in [0, 3]; got null"},
        BadCase{"device_ssd", R"("zero_optimization": {"offload_param": {"device": "ssd"}})",
                "ds.json: zero_optimization.offload_param.device: expected one of none, cpu, nvme; got \"ssd\""},
        BadCase{"device_upper", R"("zero_optimization": {"offload_optimizer": {"device": "CPU"}})",
                "zero_optimization.offload_optimizer.device: expected one of none, cpu, nvme; got \"CPU\""},
        BadCase{"nvme_without_path", R"("zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}})",
                "zero_optimization.offload_param.nvme_path: expected a directory path when device is nvme"},
        BadCase{"typo", R"("zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 1e5})",
                "ds.json: zero_optimization.stage3_param_persitence_threshold: unknown key; did you mean "
                "stage3_param_persistence_threshold?"},
        BadCase{"offload_typo", R"("zero_optimization": {"offload_param": {"devise": "cpu"}})",
                "zero_optimization.offload_param.devise: unknown key; did you mean device?"},
        BadCase{"not_an_object", R"("zero_optimization": 3)", "zero_optimization: expected an object; got 3"},
        BadCase{"alias_twice",
                R"("zero_optimization": {"stage3_max_live_parameters": 1e9, "max_live_parameters": 1e9})",
                "expected only one of stage3_max_live_parameters and max_live_parameters"},
        BadCase{"deprecated_with_replacement",
                R"("zero_optimization": {"cpu_offload": false, "offload_optimizer": {"device": "cpu"}})",
                "zero_optimization.cpu_offload: expected either cpu_offload (deprecated) or offload_optimizer; got both"},
        BadCase{"deprecated_param_with_replacement",
                R"("zero_optimization": {"stage": 3, "cpu_offload_param": true, "offload_param": {}})",
                "Cannot provide deprecated parameter 'cpu_offload_param' and replacing parameter 'offload_param'"},
        BadCase{"deprecated_gather_with_replacement",
                R"("zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true,
                    "stage3_gather_16bit_weights_on_model_save": true})",
                "zero_optimization.stage3_gather_fp16_weights_on_model_save: expected either"},
        BadCase{"partial_offload_stage2",
                R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}})",
                "Partial offloading only supported for ZeRO Stage 3."},
        BadCase{"ratio_range", R"("zero_optimization": {"offload_optimizer": {"ratio": 1.5}})",
                "zero_optimization.offload_optimizer.ratio: expected a number in [0, 1]; got 1.5"},
        // precision
        BadCase{"fp16_and_bf16", R"("fp16": {"enabled": true}, "bf16": {"enabled": true})",
                "bfloat16 and fp16 modes cannot be simultaneously enabled"},
        BadCase{"fp16_apex_key", R"("fp16": {"enabled": true, "opt_level": "O2"})",
                "ds.json: fp16.opt_level: unknown key"},
        BadCase{"loss_scale_negative", R"("fp16": {"loss_scale": -1})",
                "fp16.loss_scale: expected a number >= 0; got -1"},
        BadCase{"loss_scale_bool", R"("fp16": {"loss_scale": true})", "fp16.loss_scale: expected a number >= 0; got true"},
        BadCase{"dynamic_window_zero", R"("fp16": {"enabled": true, "loss_scale_window": 0})",
                "fp16.loss_scale_window: expected an integer > 0 with dynamic loss scaling"},
        BadCase{"dynamic_min_scale_zero", R"("fp16": {"enabled": true, "min_loss_scale": 0})",
                "fp16.min_loss_scale: expected an integer > 0 with dynamic loss scaling"},
        BadCase{"bf16_typo", R"("bf16": {"enable": true})", "bf16.enable: unknown key; did you mean enabled?"},
        BadCase{"bf16_master_stage0", R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true})",
                "bf16.bf16_master_weights_and_grads: expected false unless ZeRO stage is 1-3"},
        BadCase{"bf16_states_without_master",
                R"("zero_optimization": {"stage": 1}, "bf16": {"enabled": true, "bf16_optimizer_states": true})",
                "bf16.bf16_optimizer_states: expected false unless ZeRO stage is 1-3 and bf16_master_weights_and_grads"},
        BadCase{"legacy_bfloat16_strict", R"("bfloat16": {"enabled": true, "foo": 1})", "bfloat16.foo: unknown key"},
        // top-level scalars
        BadCase{"allreduce_op", R"("gradient_allreduce_op": "max")",
                "gradient_allreduce_op: expected one of mean, sum (any case); got \"max\""},
        BadCase{"allreduce_sum_stage3", R"("gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 3})",
                "gradient_allreduce_op: expected mean with ZeRO stage 3"},
        BadCase{"comm_dtype", R"("communication_data_type": "fp8")",
                "communication_data_type: expected one of fp16, bf16, fp32 (any case); got \"fp8\""},
        BadCase{"grad_accum_dtype", R"("data_types": {"grad_accum_dtype": "float32"})",
                "data_types.grad_accum_dtype: expected one of fp16, bf16, fp32; got \"float32\""},
        BadCase{"clipping_negative", R"("gradient_clipping": -1.0)",
                "gradient_clipping: expected a number >= 0; got -1.0"},
        BadCase{"clipping_string", R"("gradient_clipping": "1.0")",
                "gradient_clipping: expected a number >= 0; got \"1.0\""},
        BadCase{"steps_per_print_zero", R"("steps_per_print": 0)", "steps_per_print: expected an integer > 0; got 0"},
        BadCase{"wall_clock_string", R"("wall_clock_breakdown": "false")",
                "wall_clock_breakdown: expected true or false; got \"false\""},
        // plain sections
        BadCase{"aio_type", R"("aio": {"queue_depth": "auto"})",
                "aio.queue_depth: expected an integer > 0; got \"auto\" (neither DeepSpeed nor the Hugging Face"},
        BadCase{"aio_gds", R"("aio": {"use_gds": true})", "aio.use_gds: GPUDirect Storage is not implemented by zero"},
        BadCase{"act_ckpt_type", R"("activation_checkpointing": {"number_checkpoints": 2.5})",
                "activation_checkpointing.number_checkpoints: expected an integer >= 0; got 2.5"},
        // optimizer
        BadCase{"optimizer_unknown", R"("optimizer": {"type": "SGD", "params": {"lr": 0.1}})",
                "ds.json: optimizer.type: \"SGD\" is not implemented by zero; implemented: Adam, AdamW, Adagrad, Lion"},
        BadCase{"optimizer_onebit", R"("optimizer": {"type": "OneBitAdam"})",
                "optimizer.type: \"OneBitAdam\" is not implemented by zero; implemented: Adam, AdamW, Adagrad, Lion"},
        BadCase{"optimizer_no_type", R"("optimizer": {"params": {"lr": 0.1}})",
                "optimizer.type: expected one of Adam, AdamW, Adagrad, Lion; got nothing"},
        BadCase{"optimizer_unknown_param", R"("optimizer": {"type": "AdamW", "params": {"freeze_step": 10}})",
                "optimizer.params.freeze_step: unknown key; not a parameter of AdamW; expected one of lr, weight_decay"},
        BadCase{"optimizer_param_typo", R"("optimizer": {"type": "Adam", "params": {"weight_decai": 0.1}})",
                "optimizer.params.weight_decai: unknown key; did you mean weight_decay?"},
        BadCase{"max_grad_norm", R"("optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}})",
                "optimizer.params.max_grad_norm: expected no max_grad_norm"},
        BadCase{"amsgrad", R"("optimizer": {"type": "Adam", "params": {"amsgrad": true}})",
                "optimizer.params.amsgrad: true is not implemented by zero"},
        BadCase{"optim_bits", R"("optimizer": {"type": "AdamW", "params": {"optim_bits": 16}})",
                "optimizer.params.optim_bits: expected 32 (fp32 moments) or 8 (block-wise 8-bit moments); got 16"},
        BadCase{"optim_bits_lion", R"("optimizer": {"type": "Lion", "params": {"optim_bits": 8}})",
                "optimizer.params.optim_bits"},
        BadCase{"min_8bit_size", R"("optimizer": {"type": "AdamW", "params": {"optim_bits": 8, "min_8bit_size": -1}})",
                "optimizer.params.min_8bit_size"},
        BadCase{"betas_shape", R"("optimizer": {"type": "Adam", "params": {"betas": [0.9]}})",
                "optimizer.params.betas: expected a list of two numbers in [0, 1); got [0.9]"},
        BadCase{"lion_has_no_eps", R"("optimizer": {"type": "Lion", "params": {"eps": 1e-8}})",
                "optimizer.params.eps: unknown key"},
        BadCase{"optimizer_lr_string", R"("optimizer": {"type": "Adam", "params": {"lr": "1e-3"}})",
                "optimizer.params.lr: expected a number >= 0; got \"1e-3\""},
        BadCase{"optimizer_auto_other", R"("optimizer": {"type": "Adam", "params": {"bias_correction": "auto"}})",
                "optimizer.params.bias_correction: expected true or false; got \"auto\""},
        // scheduler
        BadCase{"scheduler_case", R"("scheduler": {"type": "warmuplr"})",
                "scheduler.type: \"warmuplr\" is not implemented by zero; implemented: WarmupLR, WarmupDecayLR, "
                "WarmupCosineLR, OneCycle, LRRangeTest (scheduler names are case-sensitive: did you mean WarmupLR?)"},
        BadCase{"scheduler_torch", R"("scheduler": {"type": "StepLR", "params": {"step_size": 10}})",
                "scheduler.type: \"StepLR\" is not implemented by zero"},
        BadCase{"warmup_steps_zero", R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}})",
                "scheduler.params.warmup_num_steps: expected an integer > 0; got 0"},
        BadCase{"warmup_steps_fraction", R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10.5}})",
                "scheduler.params.warmup_num_steps: expected an integer > 0; got 10.5"},
        BadCase{"decay_needs_total", R"("scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})",
                "scheduler.params.total_num_steps: expected a value (a required parameter of WarmupDecayLR); got nothing"},
        BadCase{"cosine_needs_total", R"("scheduler": {"type": "WarmupCosineLR"})",
                "scheduler.params.total_num_steps: expected a value (a required parameter of WarmupCosineLR)"},
        BadCase{"cosine_min_lr", R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                "warmup_min_lr": 0}})",
                "scheduler.params.warmup_min_lr: not a parameter of WarmupCosineLR (DeepSpeed raises TypeError)"},
        BadCase{"onecycle_needs_max", R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001}})",
                "scheduler.params.cycle_max_lr: expected a value (a required parameter of OneCycle)"},
        BadCase{"warmup_unknown_param", R"("scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}})",
                "scheduler.params.total_num_steps: unknown key"},
        BadCase{"last_batch_iteration", R"("scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}})",
                "scheduler.params.last_batch_iteration: resuming a schedule this way is not implemented by zero"},
        // unsupported features
        BadCase{"sparse_attention", R"("sparse_attention": {"mode": "fixed"})",
                "ds.json: sparse_attention: sparse attention is not implemented by zero; expected no sparse_attention "
                "section; got a sparse_attention section"},
        BadCase{"autotp", R"("tensor_parallel": {"autotp_size": 2})",
                "tensor_parallel.autotp_size: automatic tensor parallelism (AutoTP) is not implemented by zero; "
                "expected 1; got 2"},
        BadCase{"pipeline", R"("pipeline": {"stages": 2})", "pipeline.stages: pipeline parallelism is not implemented"},
        BadCase{"amp", R"("amp": {"enabled": true, "opt_level": "O1"})", "amp.enabled: Apex AMP is not implemented"},
        BadCase{"data_efficiency", R"("data_efficiency": {"enabled": true})",
                "data_efficiency.enabled: data efficiency is not implemented"},
        BadCase{"pld", R"("progressive_layer_drop": {"enabled": true})",
                "progressive_layer_drop.enabled: progressive layer drop is not implemented"},
        BadCase{"compression", R"("compression_training": {"weight_quantization": {}})",
                "compression_training: compression training is not implemented"},
        BadCase{"max_in_cpu_negative",
                R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": -1}})",
                "zero_optimization.offload_optimizer.max_in_cpu: expected an integer >= 0; got -1"},
        BadCase{"partial_offload_param",
                R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_param": {"device": "cpu"}})",
                "zero_optimization.offload_optimizer.ratio: expected 1.0 with offload_param"},
        BadCase{"quantized_weights_block", R"("zero_optimization": {"stage": 3, "zero_quantized_weights_block_size": 10})",
                "zero_optimization.zero_quantized_weights_block_size: expected a multiple of 4"},
        BadCase{"mics_negative", R"("zero_optimization": {"stage": 3, "mics_shard_size": -2})",
                "zero_optimization.mics_shard_size: expected an integer >= -1; got -2"},
        BadCase{"sequence_parallel", R"("sequence_parallel_size": 4)",
                "sequence_parallel_size: sequence parallelism is not implemented"},
        BadCase{"elasticity", R"("elasticity": {"enabled": true, "max_train_batch_size": 4})",
                "elasticity.enabled: elastic training is not implemented"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(Problems, AllMistakesOfAFileAreReportedTogether) {
  const auto problems = problems_of(R"({
    "train_batch_size": 8,
    "zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 1e5,
                          "offload_param": {"device": "ssd"}},
    "fp16": {"enabled": "yes"}
  })");
  ASSERT_EQ(problems.size(), 3u) << joined(problems);
  const std::string all = joined(problems);
  EXPECT_NE(all.find("zero_optimization.stage3_param_persitence_threshold: unknown key"), std::string::npos);
  EXPECT_NE(all.find("zero_optimization.offload_param.device: expected one of none, cpu, nvme; got \"ssd\""),
            std::string::npos);
  EXPECT_NE(all.find("fp16.enabled: expected true or false; got \"yes\""), std::string::npos);
}

// ------------------------------------------------------------ acceptance

TEST(Coercion, IntegralFloatsAndIntegerStringsInStrictSections) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": "3", "reduce_bucket_size": 5e8,
      "stage3_prefetch_bucket_size": 6.039798e+07, "sub_group_size": 1e12, "stage3_max_live_parameters": 1e9})"));
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 60397980);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000000);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000);
}

TEST(Coercion, StagesAsFloat) { EXPECT_EQ(load_string(with(R"("zero_optimization": {"stage": 2.0})")).zero.stage, 2); }

TEST(Coercion, NumericStringLossScaleAccepted) {
  EXPECT_DOUBLE_EQ(load_string(with(R"("fp16": {"enabled": true, "loss_scale": "3"})")).fp16.loss_scale, 3.0);
}

TEST(Defaults, MatchDeepSpeed) {
  const Config c = load_string(R"({"train_batch_size": 8})");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.model_persistence_threshold, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(c.zero.offload_param.pin_memory);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.gradient_allreduce_op, "mean");
  EXPECT_FALSE(c.steps_per_print.has_value());
  EXPECT_FALSE(c.optimizer.has_value());
  EXPECT_FALSE(c.scheduler.has_value());
  EXPECT_FALSE(c.mixed_precision());
  EXPECT_TRUE(c.zero_force_ds_cpu_optimizer);
  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
}

struct OverlapCase {
  const char* zero;
  bool overlap;
};
class OverlapComm : public ::testing::TestWithParam<OverlapCase> {};
TEST_P(OverlapComm, DefaultsToStageThree) {
  EXPECT_EQ(load_string(with(std::string("\"zero_optimization\": ") + GetParam().zero)).zero.overlap_comm,
            GetParam().overlap)
      << GetParam().zero;
}
INSTANTIATE_TEST_SUITE_P(Zero, OverlapComm,
                         ::testing::Values(OverlapCase{R"({"stage": 0})", false}, OverlapCase{R"({"stage": 1})", false},
                                           OverlapCase{R"({"stage": 2})", false}, OverlapCase{R"({"stage": 3})", true},
                                           OverlapCase{R"({"stage": 3, "overlap_comm": false})", false},
                                           OverlapCase{R"({"stage": 2, "overlap_comm": true})", true},
                                           OverlapCase{R"({"stage": 3, "overlap_comm": null})", true},
                                           OverlapCase{R"({"stage": 3, "overlap_comm": "auto"})", true}));

TEST(Aliases, BareAndPrefixedNamesFillTheSameField) {
  const char* pairs[][2] = {{"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
                            {"stage3_param_persistence_threshold", "param_persistence_threshold"},
                            {"stage3_model_persistence_threshold", "model_persistence_threshold"},
                            {"stage3_max_live_parameters", "max_live_parameters"},
                            {"stage3_max_reuse_distance", "max_reuse_distance"},
                            {"stage3_module_granularity_threshold", "module_granularity_threshold"}};
  for (const auto& pair : pairs) {
    for (const char* name : pair) {
      const Config c = load_string(with(std::string(R"("zero_optimization": {"stage": 3, ")") + name + "\": 1234}"));
      const int64_t values[] = {c.zero.prefetch_bucket_size, c.zero.param_persistence_threshold,
                                c.zero.model_persistence_threshold, c.zero.max_live_parameters,
                                c.zero.max_reuse_distance, c.zero.module_granularity_threshold};
      EXPECT_EQ(std::count(std::begin(values), std::end(values), 1234), 1) << name;
      // Both spellings resolve to one canonical entry.
      EXPECT_NE(c.canonical_json.find(std::string("\"") + pair[0] + "\":1234"), std::string::npos) << name;
    }
  }
  for (const char* name : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"}) {
    EXPECT_TRUE(load_string(with(std::string(R"("zero_optimization": {")") + name + "\": true}"))
                    .zero.gather_16bit_weights_on_model_save);
  }
  EXPECT_TRUE(load_string(with(R"("zero_optimization": {"use_all_reduce_for_fetch_params": true})"))
                  .zero.use_all_reduce_for_fetch_params);
  EXPECT_TRUE(load_string(with(R"("zero_optimization": {"stage3_allgather_sequential": true})"))
                  .zero.allgather_sequential);
}

// NOTE [partial offload]: accepted at stage 3 with cpu; without an
// offload it changes nothing, and says so.
TEST(PartialOffload, RatioAtStage3WithCpu) {
  const Config c = load_string(
      with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}})"));
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
  const Config none = load_string(with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.5}})"));
  EXPECT_TRUE(has_warning(none, "zero_optimization.offload_optimizer.ratio: has no effect without "
                                "offload_optimizer.device \"cpu\" or \"nvme\"")) << joined(none.warnings);
}

// NOTE [state placement]: the device's share and max_in_cpu with nvme;
// max_in_cpu without nvme changes nothing, and says so.
TEST(StatePlacement, RatioAndMaxInCpuWithNvme) {
  const Config c = load_string(with(
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.3, "max_in_cpu": 5000}})"));
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_EQ(c.zero.offload_optimizer.max_in_cpu, 5000);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
  EXPECT_EQ(load_string(with(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}})"))
                .zero.offload_optimizer.max_in_cpu,
            0);  // every offloaded state on NVMe, as before the key
  const Config cpu = load_string(
      with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "max_in_cpu": 5000}})"));
  EXPECT_TRUE(has_warning(cpu, "zero_optimization.offload_optimizer.max_in_cpu: has no effect without "
                               "offload_optimizer.device \"nvme\"")) << joined(cpu.warnings);
}

// ZeRO++'s qwZ, hpZ and qgZ (NOTE [quantized gather], NOTE [hpZ], NOTE
// [quantized gradients]): read at stage
// 3, said to do nothing below it; hpZ's groups divide the world.
TEST(ZeroPlusPlus, QuantizedWeightsAndHpzAreReadAndChecked) {
  const Config c = load_string(with(
      R"("zero_optimization": {"stage": 3, "zero_quantized_weights": true, "zero_hpz_partition_size": 2, "zero_quantized_weights_block_size": 512, "zero_quantized_gradients": true})"));
  EXPECT_TRUE(c.zero.zero_quantized_weights);
  EXPECT_TRUE(c.zero.zero_quantized_gradients);
  EXPECT_EQ(c.zero.zero_hpz_partition_size, 2);
  EXPECT_EQ(c.zero.zero_quantized_weights_block_size, 512);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
  EXPECT_EQ(load_string(with(R"("zero_optimization": {"stage": 3})")).zero.zero_quantized_weights_block_size, 8000);
  const Config stage2 = load_string(
      with(R"("zero_optimization": {"stage": 2, "zero_quantized_weights": true, "zero_hpz_partition_size": 2, "zero_quantized_gradients": true})"));
  EXPECT_TRUE(has_warning(stage2, "zero_optimization.zero_quantized_weights: has no effect below stage 3"))
      << joined(stage2.warnings);
  EXPECT_TRUE(has_warning(stage2, "zero_optimization.zero_hpz_partition_size: has no effect below stage 3"))
      << joined(stage2.warnings);
  EXPECT_TRUE(has_warning(stage2, "zero_optimization.zero_quantized_gradients: has no effect below stage 3"))
      << joined(stage2.warnings);
  const Config frozen = load_string(
      with(R"("zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": true})"));
  EXPECT_TRUE(has_warning(frozen, "zero_optimization.zero_quantized_nontrainable_weights"))
      << joined(frozen.warnings);
  const auto problems = problems_of(with(R"("zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3})"), 4);
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  EXPECT_NE(problems[0].find("zero_optimization.zero_hpz_partition_size: expected a divisor of the world size 4"),
            std::string::npos)
      << problems[0];
  EXPECT_TRUE(problems_of(with(R"("zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2})"), 4).empty());
}

// NOTE [MiCS]: the shard size divides the world; below stage 2 it warns, and
// with ZeRO++'s hpZ or qgZ at stage 3 it is refused; the hierarchical
// gather warns without MiCS at stage 3. The partition spans a shard group.
TEST(MicsConfig, ShardSizeIsReadAndChecked) {
  LoadOptions four;
  four.world_size = 4;
  const Config c = load_string(
      with(R"("zero_optimization": {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": true})"),
      four);
  EXPECT_EQ(c.zero.mics_shard_size, 2);
  EXPECT_TRUE(c.zero.mics_hierarchical_params_gather);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
  EXPECT_EQ(partition_ranks(c), 2);
  EXPECT_EQ(partition_ranks(load_string(with(R"("zero_optimization": {"stage": 2})"), four)), 4);
  EXPECT_EQ(partition_ranks(load_string(with(R"("zero_optimization": {"stage": 2, "mics_shard_size": 4})"), four)), 4);
  EXPECT_EQ(partition_ranks(load_string(with(R"("zero_optimization": {"stage": 2, "mics_shard_size": 1})"), four)), 1);
  EXPECT_EQ(load_string(with(R"("zero_optimization": {"stage": 3})")).zero.mics_shard_size, -1);

  const Config stage1 = load_string(with(R"("zero_optimization": {"stage": 1, "mics_shard_size": 2})"), four);
  EXPECT_TRUE(has_warning(stage1, "zero_optimization.mics_shard_size: has no effect below stage 2")) << joined(stage1.warnings);
  EXPECT_EQ(partition_ranks(stage1), 4);
  const Config flat = load_string(with(R"("zero_optimization": {"stage": 2, "mics_hierarchical_params_gather": true})"));
  EXPECT_TRUE(has_warning(flat, "zero_optimization.mics_hierarchical_params_gather: has no effect without "
                                "mics_shard_size at stage 3"))
      << joined(flat.warnings);

  auto problems = problems_of(with(R"("zero_optimization": {"stage": 3, "mics_shard_size": 3})"), 4);
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  EXPECT_NE(problems[0].find("zero_optimization.mics_shard_size: expected a divisor of the world size 4"),
            std::string::npos) << problems[0];
  problems = problems_of(with(R"("zero_optimization": {"stage": 2, "mics_shard_size": 8})"), 4);
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  problems = problems_of(with(R"("zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2,
                                 "zero_quantized_gradients": true, "zero_quantized_weights": true})"), 4);
  ASSERT_EQ(problems.size(), 2u) << joined(problems);
  EXPECT_NE(joined(problems).find("zero_optimization.zero_hpz_partition_size: expected 1 with mics_shard_size"),
            std::string::npos) << joined(problems);
  EXPECT_NE(joined(problems).find("zero_optimization.zero_quantized_gradients: expected false with mics_shard_size"),
            std::string::npos) << joined(problems);
}

// NOTE [device gradients]: zero's own key; without a partition offloaded
// it changes nothing, and with super_offload it is refused.
TEST(DeviceGradients, ReadAndCheckedAgainstTheStageAndSuperOffload) {
  const Config c = load_string(
      with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "gradients_on_device": true}})"));
  EXPECT_TRUE(c.zero.offload_optimizer.gradients_on_device);
  EXPECT_TRUE(c.warnings.empty()) << joined(c.warnings);
  const Config stage1 = load_string(
      with(R"("zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "gradients_on_device": true}})"));
  EXPECT_TRUE(has_warning(stage1, "zero_optimization.offload_optimizer.gradients_on_device: has no effect"))
      << joined(stage1.warnings);
  const auto problems = problems_of(with(
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "gradients_on_device": true, "super_offload": true}})"));
  ASSERT_EQ(problems.size(), 1u) << joined(problems);
  EXPECT_NE(problems[0].find("gradients_on_device: expected false with offload_optimizer.super_offload"), std::string::npos)
      << problems[0];
}

TEST(Deprecated, CpuOffloadBecomesOffloadOptimizerWithAWarning) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 2, "cpu_offload": true})"));
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(has_warning(c, "zero_optimization.cpu_offload: deprecated; use offload_optimizer")) << joined(c.warnings);
}

TEST(Deprecated, CpuOffloadParamBecomesOffloadParam) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 3, "cpu_offload_param": true,
      "cpu_offload_use_pin_memory": true})"));
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(has_warning(c, "cpu_offload_param: deprecated"));
  EXPECT_TRUE(has_warning(c, "cpu_offload_use_pin_memory: deprecated and without effect"));
}

TEST(Deprecated, CpuOffloadFalseIsNoOffload) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 2, "cpu_offload": false})"));
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNone);
}

TEST(Deprecated, Gather16bitFp16Spelling) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 3,
      "stage3_gather_fp16_weights_on_model_save": true})"));
  EXPECT_TRUE(c.zero.gather_16bit_weights_on_model_save);
  EXPECT_TRUE(has_warning(c, "stage3_gather_fp16_weights_on_model_save: deprecated"));
}

TEST(Deprecated, BooleanZeroOptimization) {
  const Config on = load_string(with(R"("zero_optimization": true, "allgather_size": 2e8)"));
  EXPECT_EQ(on.zero.stage, 1);
  EXPECT_EQ(on.zero.allgather_bucket_size, 200000000);
  EXPECT_TRUE(has_warning(on, "zero_optimization: a boolean is deprecated"));
  const Config off = load_string(with(R"("zero_optimization": false, "allgather_size": 2e8)"));
  EXPECT_EQ(off.zero.stage, 0);
  EXPECT_EQ(off.zero.allgather_bucket_size, 500000000);
}

TEST(Precision, LegacyBfloat16OnlyWithoutBf16) {
  const Config legacy = load_string(with(R"("bfloat16": {"enabled": true})"));
  EXPECT_TRUE(legacy.bf16.enabled);
  EXPECT_TRUE(has_warning(legacy, "bfloat16: legacy name of bf16"));
  const Config both = load_string(with(R"("bf16": {"enabled": false}, "bfloat16": {"enabled": true, "x": 1})"));
  EXPECT_FALSE(both.bf16.enabled);
  EXPECT_TRUE(has_warning(both, "bfloat16: ignored because bf16 is present"));
}

TEST(Precision, StaticLossScaleAllowsAnyWindow) {
  const Config c = load_string(with(R"("fp16": {"enabled": true, "loss_scale": 128, "loss_scale_window": 0})"));
  EXPECT_DOUBLE_EQ(c.fp16.loss_scale, 128.0);
  const Config off = load_string(with(R"("fp16": {"enabled": false, "min_loss_scale": 0})"));
  EXPECT_FALSE(off.fp16.enabled);
}

TEST(Precision, AutoWithoutPrecisionIsDroppedWithAWarning) {
  const Config c = load_string(with(R"("fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"})"));
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_TRUE(has_warning(c, "fp16.enabled: \"auto\" is not resolved, so it is dropped as DeepSpeed does; using the "
                             "default false (AutoValues::precision would fill it)"))
      << joined(c.warnings);
  for (const ResolvedValue& r : c.resolved) {
    if (r.path == "fp16.enabled") {
      EXPECT_EQ(r.origin, Origin::kDefault);
    }
  }
}

TEST(Scalars, CommunicationAndAllreduce) {
  const Config c = load_string(with(R"("communication_data_type": "BF16", "gradient_allreduce_op": "Sum",
      "steps_per_print": 1e5, "gradient_clipping": 0, "prescale_gradients": true,
      "seq_parallel_communication_data_type": "bf16")"));
  EXPECT_EQ(c.communication_data_type, "bf16");
  EXPECT_EQ(c.gradient_allreduce_op, "sum");
  EXPECT_EQ(c.steps_per_print, 100000);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.0);
  EXPECT_TRUE(c.prescale_gradients);
}

TEST(Optimizer, TypesAreCaseInsensitiveWithDeepSpeedDefaults) {
  const Config adam = load_string(with(R"("optimizer": {"type": "adam", "params": {"adam_w_mode": false}})"));
  ASSERT_TRUE(adam.optimizer.has_value());
  EXPECT_EQ(adam.optimizer->type, OptimizerType::kAdam);
  EXPECT_EQ(adam.optimizer->type_name, "adam");
  EXPECT_FALSE(adam.optimizer->adam_w_mode);
  EXPECT_DOUBLE_EQ(adam.optimizer->weight_decay, 0.0);
  const Config adamw = load_string(with(R"("optimizer": {"type": "ADAMW", "params": {"adam_w_mode": false}})"));
  EXPECT_EQ(adamw.optimizer->type, OptimizerType::kAdamW);
  EXPECT_TRUE(adamw.optimizer->adam_w_mode);
  EXPECT_TRUE(has_warning(adamw, "optimizer.params.adam_w_mode: false is ignored for AdamW"));
  const Config adagrad = load_string(with(R"("optimizer": {"type": "Adagrad",
      "params": {"initial_accumulator_value": 0.1}})"));
  EXPECT_EQ(adagrad.optimizer->type, OptimizerType::kAdagrad);
  EXPECT_DOUBLE_EQ(adagrad.optimizer->initial_accumulator_value, 0.1);
  const Config lion = load_string(with(R"("optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98]}})"));
  EXPECT_EQ(lion.optimizer->type, OptimizerType::kLion);
  EXPECT_DOUBLE_EQ(lion.optimizer->betas[0], 0.95);
}

TEST(Optimizer, OptimBitsEightForAdam) {
  EXPECT_EQ(load_string(with(R"("optimizer": {"type": "AdamW", "params": {"optim_bits": 8}})")).optimizer->optim_bits, 8);
  // bitsandbytes' min_8bit_size, its default 4096.
  EXPECT_EQ(load_string(with(R"("optimizer": {"type": "AdamW", "params": {"optim_bits": 8}})")).optimizer->min_8bit_size, 4096);
  EXPECT_EQ(load_string(with(R"("optimizer": {"type": "AdamW", "params": {"optim_bits": 8, "min_8bit_size": 0}})"))
                .optimizer->min_8bit_size,
            0);
  EXPECT_EQ(load_string(with(R"("optimizer": {"type": "Adam"})")).optimizer->optim_bits, 32);
}

TEST(Optimizer, TorchAdamIsAcceptedWithAWarning) {
  const Config c = load_string(with(R"("optimizer": {"type": "Adam", "params": {"torch_adam": true}})"));
  EXPECT_TRUE(has_warning(c, "optimizer.params.torch_adam: ignored"));
}

TEST(Scheduler, TypesAndDefaults) {
  const Config warm = load_string(with(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})"));
  ASSERT_TRUE(warm.scheduler.has_value());
  EXPECT_EQ(warm.scheduler->warmup_type, WarmupType::kLog);
  EXPECT_FALSE(warm.scheduler->warmup_max_lr.has_value());
  EXPECT_EQ(warm.scheduler->warmup_num_steps, 1000);
  EXPECT_TRUE(has_warning(warm, "scheduler.params.warmup_type: expected log or linear; got \"cosine\""));
  const Config cosine = load_string(with(R"("scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": 1e4, "warmup_type": "linear"}})"));
  EXPECT_EQ(cosine.scheduler->type, SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(cosine.scheduler->total_num_steps, 10000);
  EXPECT_EQ(cosine.scheduler->warmup_type, WarmupType::kLinear);
  EXPECT_DOUBLE_EQ(cosine.scheduler->cos_min_ratio, 1e-4);
  const Config cycle = load_string(with(R"("scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100}})"));
  EXPECT_EQ(cycle.scheduler->type, SchedulerType::kOneCycle);
  EXPECT_DOUBLE_EQ(cycle.scheduler->cycle_max_lr, 1e-3);
  EXPECT_FALSE(cycle.scheduler->cycle_second_step_size.has_value());
  EXPECT_DOUBLE_EQ(cycle.scheduler->cycle_max_mom, 0.9);
  const Config range = load_string(with(R"("scheduler": {"type": "LRRangeTest",
      "params": {"lr_range_test_staircase": true}})"));
  EXPECT_EQ(range.scheduler->type, SchedulerType::kLRRangeTest);
  EXPECT_TRUE(range.scheduler->lr_range_test_staircase);
}

TEST(Features, WarningsForFeaturesThatDoNotChangeTheMath) {
  const Config c = load_string(with(R"("flops_profiler": {"enabled": true}, "tensorboard": {"enabled": true},
      "wandb": {"enabled": false}, "comms_logger": {"enabled": true}, "checkpoint": {"tag_validation": "Warn"},
      "dataloader_drop_last": true, "dump_state": true, "zero_force_ds_cpu_optimizer": false,
      "fp16": {"enabled": true, "auto_cast": true}, "memory_breakdown": true,
      "aio": {"thread_count": 4}, "_comment": "x", "cuda_visible_devices": 0)"));
  for (const char* text :
       {"flops_profiler.enabled: the flops profiler is not implemented by zero; ignored (training is unchanged)",
        "tensorboard.enabled: TensorBoard monitoring", "comms_logger.enabled", "checkpoint: DeepSpeed's checkpoint options do not apply",
        "dataloader_drop_last", "dump_state", "zero_force_ds_cpu_optimizer: false has no effect", "fp16.auto_cast",
        "aio.thread_count: legacy name of intra_op_parallelism, used as that"}) {
    EXPECT_TRUE(has_warning(c, text)) << text << "\n" << joined(c.warnings);
  }
  EXPECT_FALSE(has_warning(c, "wandb"));
  EXPECT_FALSE(has_warning(c, "_comment")) << "a comment by convention";
  EXPECT_TRUE(has_warning(c, "cuda_visible_devices: unknown top-level key, ignored as DeepSpeed does"))
      << joined(c.warnings);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(c.memory_breakdown);
  EXPECT_FALSE(c.zero_force_ds_cpu_optimizer);
}

// Every key zero reads is acted on or named (NOTE [unsupported features]):
// the ones that only tune how DeepSpeed runs warn, with the value given.
TEST(Features, KeysWithoutEffectHereWarnNamingTheValue) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 3, "allgather_partitions": false,
      "use_multi_rank_bucket_allreduce": false, "round_robin_gradients": true, "ignore_unused_parameters": false,
      "load_from_fp32_weights": false, "elastic_checkpoint": true, "stage3_module_granularity_threshold": 100,
      "stage3_use_all_reduce_for_fetch_params": true, "stage3_allgather_sequential": true,
      "offload_optimizer": {"device": "cpu", "fast_init": true, "cpuadam_cores_perc": 0.5}},
      "bf16": {"enabled": true, "immediate_grad_update": true}, "zero_allow_untested_optimizer": true)"));
  for (const char* text :
       {"zero_optimization.allgather_partitions: false has no effect", "use_multi_rank_bucket_allreduce: false has no effect",
        "zero_optimization.round_robin_gradients: true has no effect", "ignore_unused_parameters: false has no effect",
        "load_from_fp32_weights: false has no effect", "elastic_checkpoint: true has no effect",
        "stage3_module_granularity_threshold: 100 has no effect", "stage3_use_all_reduce_for_fetch_params: true has no effect",
        "stage3_allgather_sequential: true has no effect", "offload_optimizer.fast_init: true has no effect",
        "offload_optimizer.cpuadam_cores_perc: 0.5 has no effect", "bf16.immediate_grad_update: true has no effect",
        "zero_allow_untested_optimizer: true has no effect"}) {
    EXPECT_TRUE(has_warning(c, text)) << text << "\n" << joined(c.warnings);
  }
}

// DeepSpeed's low-precision master and states (NOTE [16-bit master] in
// optim/) are read at stages 1-3; bf16 states reach the optimizer's config;
// stochastic rounding is on unless turned off; a master flag without its
// precision enabled is ignored, saying so; bf16 states with 8-bit ones are
// refused.
TEST(Precision, SixteenBitMasterWeightsAndStatesAreRead) {
  const std::string stage1 =
      R"("zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, )";
  {
    const Config c = load_string(with(stage1 + R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true})"));
    EXPECT_TRUE(c.bf16.bf16_master_weights_and_grads);
    ASSERT_TRUE(c.optimizer);
    EXPECT_TRUE(c.optimizer->bf16_states);
    EXPECT_TRUE(c.bf16.stochastic_rounding);
  }
  {
    const Config c = load_string(with(stage1 + R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "stochastic_rounding": false})"));
    ASSERT_TRUE(c.optimizer);
    EXPECT_FALSE(c.optimizer->bf16_states);
    EXPECT_FALSE(c.bf16.stochastic_rounding);
  }
  {
    const Config c = load_string(with(stage1 + R"("fp16": {"enabled": true, "fp16_master_weights_and_grads": true})"));
    EXPECT_TRUE(c.fp16.fp16_master_weights_and_grads);
    EXPECT_TRUE(c.fp16.stochastic_rounding);
  }
  {
    const Config c = load_string(with(stage1 + R"("bf16": {"enabled": false, "bf16_master_weights_and_grads": true})"));
    EXPECT_TRUE(has_warning(c, "bf16.bf16_master_weights_and_grads: ignored: bf16.enabled is false")) << joined(c.warnings);
  }
  try {
    load_string(with(R"("zero_optimization": {"stage": 1}, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true, )"
                     R"("bf16_optimizer_states": true}, "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "optim_bits": 8}})"));
    ADD_FAILURE() << "expected a ConfigError for bf16 and 8-bit states at once";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bf16.bf16_optimizer_states: expected false with optimizer.params.optim_bits 8"),
              std::string::npos)
        << e.what();
  }
}

TEST(TopLevel, UnknownKeysWarnWithTheNearestKnownOne) {
  const Config c = load_string(with(R"("gradient_cliping": 0.5, "steps_per_prnt": 10, "my_launcher_setting": 1,
                                       "_note": "comments start with an underscore")"));
  EXPECT_TRUE(has_warning(c, "<string>: gradient_cliping: unknown top-level key, ignored as DeepSpeed does; did you "
                             "mean gradient_clipping?"))
      << joined(c.warnings);
  EXPECT_TRUE(has_warning(c, "steps_per_prnt: unknown top-level key"));
  EXPECT_TRUE(has_warning(c, "<string>: my_launcher_setting: unknown top-level key, ignored as DeepSpeed does"))
      << joined(c.warnings);
  EXPECT_FALSE(has_warning(c, "my_launcher_setting: unknown top-level key, ignored as DeepSpeed does; did you"))
      << "no near match, no suggestion";
  EXPECT_FALSE(has_warning(c, "_note"));
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);  // the typo is not read
}

TEST(PlainSections, UnknownKeysWarn) {
  const Config c = load_string(with(R"("activation_checkpointing": {"partition_activation": true})"));
  EXPECT_TRUE(has_warning(c, "activation_checkpointing.partition_activation: unknown key, ignored as DeepSpeed does; "
                             "did you mean partition_activations?"))
      << joined(c.warnings);
  EXPECT_FALSE(c.activation_checkpointing.partition_activations);
}

TEST(Offload, StageWarnings) {
  const Config c = load_string(with(R"("zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}})"));
  EXPECT_TRUE(has_warning(c, "zero_optimization.offload_param: has no effect below stage 3"));
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
}

// offload_optimizer.super_offload (NOTE [speculative step]): read at stage 3
// with the optimizer in host memory; where it cannot run, as DeepSpeed, a
// warning says the step waits for backward.
TEST(Offload, SuperOffloadWhereItRunsAndWhereItDoesNot) {
  const Config on = load_string(with(
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": true}})"));
  EXPECT_TRUE(on.zero.offload_optimizer.super_offload);
  EXPECT_FALSE(has_warning(on, "super_offload")) << joined(on.warnings);
  EXPECT_FALSE(load_string(with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}})"))
                   .zero.offload_optimizer.super_offload);
  const Config stage2 = load_string(with(
      R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": true}})"));
  EXPECT_TRUE(has_warning(stage2, "zero_optimization.offload_optimizer.super_offload: has no effect below stage 3"))
      << joined(stage2.warnings);
  const Config nvme = load_string(with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
      "nvme_path": "/tmp", "super_offload": true}})"));
  EXPECT_TRUE(has_warning(nvme, "super_offload: has no effect without offload_optimizer.device \"cpu\" (it is \"nvme\")"))
      << joined(nvme.warnings);
  const Config params = load_string(with(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu", "super_offload": true}})"));
  EXPECT_TRUE(has_warning(params, "super_offload: has no effect with offload_param")) << joined(params.warnings);
  EXPECT_FALSE(problems_of(with(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"super_offload": 1}})"))
                   .empty())
      << "a boolean";
}

// A config saved as UTF-16 (some Windows editors), or a binary file, is
// named as such, not reported as a JSON error at its first odd byte.
TEST(Encoding, Utf16AndNulBytesAreNamed) {
  const std::string text = R"({"train_batch_size": 8})";
  std::string utf16 = "\xff\xfe";
  for (char c : text) utf16 += std::string(1, c) + '\0';
  std::string joined_problems = joined(problems_of(utf16));
  EXPECT_NE(joined_problems.find("is UTF-16 or UTF-32 text"), std::string::npos) << joined_problems;
  std::string no_mark;
  for (char c : text) no_mark += std::string(1, c) + '\0';
  joined_problems = joined(problems_of(no_mark));
  EXPECT_NE(joined_problems.find("is UTF-16 or UTF-32 text"), std::string::npos) << joined_problems;
  joined_problems = joined(problems_of(std::string("{\"train_batch_size\":\n 8}") + '\0'));
  EXPECT_NE(joined_problems.find("holds a NUL byte at byte 24 (line 2)"), std::string::npos) << joined_problems;
}

}  // namespace
}  // namespace zero::config
