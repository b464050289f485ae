// The stage-3 plan (NOTE [stage-3 plan]) of small models: which modules are
// layers, which parameters stay whole under the two persistence thresholds,
// a tied parameter's one group, and which shards stay in host memory.
#include <gtest/gtest.h>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "zero/config/config.h"
#include "zero/partition/stage3_plan.h"

namespace {

using zero::partition::plan_stage3;
using zero::partition::Stage3Plan;

// embed (outside every container) -> blocks: ModuleList of 3 Linear(16, 16) -> head
struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_module("embed", torch::nn::Linear(4, 16));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(torch::nn::Linear(16, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
  torch::nn::Linear embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

zero::config::Config config(const std::string& zero) {
  return zero::config::load_string(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, )" + zero + "}}");
}

std::vector<std::string> names(const zero::partition::GroupSpec& g) {
  std::vector<std::string> out;
  for (const auto& [n, p] : g.params) out.push_back(n);
  return out;
}

TEST(Stage3Plan, LayersGroupsAndPersistentParameters) {
  Net net;
  // Thresholds: 16-element biases stay whole; 256-element weights do not.
  const Stage3Plan plan = plan_stage3(net.ptr(), config(R"("stage3_param_persistence_threshold": 100)"), {}, nullptr,
                                      "rank0");
  ASSERT_EQ(plan.layout.units.size(), 3u) << "the ModuleList's children";
  EXPECT_EQ(plan.layout.units[1].name, "blocks.1");
  ASSERT_EQ(plan.layout.groups.size(), 4u);
  EXPECT_EQ(names(plan.layout.groups[1]), std::vector<std::string>{"blocks.0.weight"});
  // Group 0: everything outside the layers and the whole (persistent) biases.
  const auto g0 = names(plan.layout.groups[0]);
  for (const char* n : {"embed.weight", "embed.bias", "blocks.0.bias", "blocks.2.bias", "norm.weight", "norm.bias"})
    EXPECT_NE(std::find(g0.begin(), g0.end(), n), g0.end()) << n;
  EXPECT_EQ(plan.layer_params, 3 * 256);
}

TEST(Stage3Plan, TheModelThresholdCapsTheWholeParameters) {
  Net net;
  // 100-element threshold; the model budget takes only two 16-element biases.
  const Stage3Plan plan = plan_stage3(
      net.ptr(), config(R"("stage3_param_persistence_threshold": 100, "stage3_model_persistence_threshold": 40)"),
      {}, nullptr, "rank0");
  // embed.bias (16) and blocks.0.bias (16) fit the 40; the rest are partitioned with their layer.
  EXPECT_EQ(names(plan.layout.groups[1]), (std::vector<std::string>{"blocks.0.weight"}));
  EXPECT_EQ(names(plan.layout.groups[2]), (std::vector<std::string>{"blocks.1.weight", "blocks.1.bias"}));
}

// A layer whose weight is another layer's (tied).
struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(const at::Tensor& w) {
    register_parameter("weight", w);
    register_parameter("bias", at::zeros({16}).requires_grad_());
  }
};
TORCH_MODULE(Tied);

TEST(Stage3Plan, ListedModulesAreLayersAndATiedParameterHasOneGroup) {
  Net net;
  net->blocks->push_back(Tied(net->blocks[0]->as<torch::nn::Linear>()->weight));  // blocks.3
  const Stage3Plan plan = plan_stage3(net.ptr(), config(R"("stage3_param_persistence_threshold": 0)"),
                                      {net->embed.ptr()}, nullptr, "rank0");
  ASSERT_EQ(plan.layout.units.size(), 5u) << "embed, then the four blocks";
  EXPECT_EQ(plan.layout.units[0].name, "embed");
  // blocks.3 uses blocks.0's group for the tied weight, and its own for its bias.
  const auto& tied = plan.layout.units[4];
  EXPECT_EQ(tied.name, "blocks.3");
  ASSERT_EQ(tied.groups.size(), 2u);
  EXPECT_EQ(tied.groups[0], plan.layout.units[1].groups[0]);
  EXPECT_EQ(names(plan.layout.groups[tied.groups[1]]), std::vector<std::string>{"blocks.3.bias"});
}

TEST(Stage3Plan, MaxInCpuKeepsTheFirstShardsInMemory) {
  Net net;
  const Stage3Plan plan = plan_stage3(
      net.ptr(), config(R"("stage3_param_persistence_threshold": 0, "offload_param": {"device": "nvme",
                            "nvme_path": "/tmp", "max_in_cpu": 600})"),
      {}, nullptr, "rank0");
  ASSERT_TRUE(plan.layout.nvme_param.has_value());
  // Each layer's shard pads 272 elements to 512: the first fits in 600, the next ones do not.
  EXPECT_EQ(plan.layout.nvme_param->in_memory, (std::vector<bool>{true, true, false, false}));
}

}  // namespace
