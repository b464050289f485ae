// The engine's device-host transfers (NOTE [device streams], NOTE [offload
// transfers], NOTE [stage-3 gather stream]) with every copy held back until
// it is waited for (CopyMode::kDeferred): a missing wait reads stale values
// (the parameters differ) or writes a host buffer a copy may still read (an
// InternalError). Each configuration must give the same bits as with
// immediate copies, on one process.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "data.h"
#include "model.h"
#include "zero/zero.h"

namespace {

struct Case {
  const char* name;
  const char* zero;         // the zero_optimization section, without braces; %s: an NVMe folder
  const char* precision;    // extra top-level keys
  bool checkpoint = false;  // activation checkpointing of every block
};

std::string fill(std::string text, const std::string& dir) {
  for (size_t at; (at = text.find("%s")) != std::string::npos;) text.replace(at, 2, dir);
  return text;
}

// Trains 3 steps of a tiny minGPT; returns every parameter (fp32) and the norm.
std::pair<std::vector<torch::Tensor>, double> train(const Case& c, zero::CopyMode mode, const std::string& dir) {
  mingpt::GPTConfig g;
  g.vocab_size = 10;
  g.block_size = 6;
  g.n_layer = 3;
  g.n_head = 2;
  g.n_embd = 32;
  g.embd_pdrop = g.resid_pdrop = g.attn_pdrop = c.checkpoint ? 0.1 : 0.0;  // checkpointing: dropout replayed
  torch::manual_seed(11);
  mingpt::GPT model(g);
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  o.cpu_copy_mode = mode;
  const std::string config = std::string(R"({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,)") +
                             R"( "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},)" +
                             R"( "activation_checkpointing": {"cpu_checkpointing": true},)" + c.precision +
                             R"( "zero_optimization": {)" + fill(c.zero, dir) + "}}";
  auto engine = zero::initialize(model.ptr(), config, o);
  if (c.checkpoint) model->set_checkpointer(&engine.checkpointer());
  auto task = mingpt::make_addition_task(2);
  torch::manual_seed(5);
  for (int s = 0; s < 6; ++s) {  // 3 steps of 2 micro-batches
    auto b = task->train_batch({8 * s, 8 * s + 1, 8 * s + 2, 8 * s + 3, 8 * s + 4, 8 * s + 5, 8 * s + 6, 8 * s + 7});
    auto logits = model->forward(b.x);
    auto loss = torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat).view({-1, logits.size(-1)}), b.y.view({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
    engine.backward(loss);
    engine.step();
  }
  EXPECT_EQ(engine.global_steps(), 3);
  std::vector<torch::Tensor> params;
  const double l2 = engine.parameter_l2();
  if (engine.config().zero.stage < 3)
    for (auto& p : model->parameters()) params.push_back(p.detach().to(torch::kFloat).clone());
  return {params, l2};
}

class DeferredCopies : public ::testing::TestWithParam<Case> {};

TEST_P(DeferredCopies, GiveTheSameBitsAsImmediateCopies) {
  const Case& c = GetParam();
  const std::string dir =
      std::string(ZERO_BINARY_DIR) + "/tests/deferred_" + std::to_string(getpid()) + "_" + c.name;
  std::filesystem::create_directories(dir);
  const auto immediate = train(c, zero::CopyMode::kImmediate, dir);
  std::pair<std::vector<torch::Tensor>, double> deferred;
  ASSERT_NO_THROW(deferred = train(c, zero::CopyMode::kDeferred, dir));
  EXPECT_EQ(deferred.second, immediate.second) << "parameter norm";
  ASSERT_EQ(deferred.first.size(), immediate.first.size());
  for (size_t i = 0; i < immediate.first.size(); ++i)
    EXPECT_TRUE(torch::equal(deferred.first[i], immediate.first[i])) << "parameter " << i;
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Offload, DeferredCopies,
    ::testing::Values(
        Case{"stage1_cpu", R"("stage": 1, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"})", ""},
        Case{"stage1_cpu_bf16", R"("stage": 1, "sub_group_size": 3000, "offload_optimizer": {"device": "cpu"})",
             R"("bf16": {"enabled": true},)"},
        Case{"stage2_cpu", R"("stage": 2, "reduce_bucket_size": 4000, "offload_optimizer": {"device": "cpu"})", ""},
        Case{"stage2_nvme_fp16",
             R"("stage": 2, "reduce_bucket_size": 4000, "sub_group_size": 5000, )"
             R"("offload_optimizer": {"device": "nvme", "nvme_path": "%s", "pipeline_read": true, "pipeline_write": true})",
             R"("fp16": {"enabled": true, "initial_scale_power": 8},)"},
        Case{"stage3_optimizer_cpu",
             R"("stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"})", ""},
        Case{"stage3_super_offload_bf16",
             R"("stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 2000, )"
             R"("offload_optimizer": {"device": "cpu", "super_offload": true})",
             R"("bf16": {"enabled": true},)"},
        Case{"stage3_params_cpu_bf16",
             R"("stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}, )"
             R"("offload_param": {"device": "cpu"})",
             R"("bf16": {"enabled": true},)"},
        Case{"stage3_params_nvme",
             R"("stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}, )"
             R"("offload_param": {"device": "nvme", "nvme_path": "%s", "max_in_cpu": 0, "buffer_count": 2})",
             ""},
        Case{"stage2_cpu_checkpointing", R"("stage": 2, "offload_optimizer": {"device": "cpu"})", "", true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
