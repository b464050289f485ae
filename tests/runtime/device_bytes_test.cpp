// The CPU twin of GpuOffload.Stage3ParametersOnTheHostAndOnNvmeEqualOnTheDevice's
// byte count: at stage 3 with offload_param and offload_optimizer on the
// host, the device keeps only the always-gathered group (the parameters
// outside every layer), padded as NOTE [flat layout] pads it: to a multiple
// of 256 elements a rank, 1792 here (the card counted 3584 bytes in bf16,
// where its test had wrongly expected a power of two, 2048).
#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>

#include "data.h"
#include "tiny_gpt.h"
#include "zero/partition/flat_parameters.h"
#include "zero/zero.h"

namespace {

TEST(Stage3Bytes, TheAlwaysGatheredGroupIsAllThatStaysOnTheDevice) {
  const mingpt::GPTConfig c = zero::test::tiny_gpt_config(64, 4);  // tests/gpu's gpt()
  torch::manual_seed(3);
  mingpt::GPT model(c);
  // Outside the blocks: wte, wpe, ln_f (weight and bias), the head.
  const int64_t outside = 10 * 64 + 6 * 64 + 2 * 64 + 64 * 10;
  ASSERT_EQ(outside, 1792);
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  o.cpu_copy_mode = zero::CopyMode::kDeferred;
  auto engine = zero::initialize(
      model.ptr(),
      R"({"train_micro_batch_size_per_gpu": 32, "bf16": {"enabled": true},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})",
      o);
  auto task = mingpt::make_addition_task(2);
  for (int s = 0; s < 2; ++s) {
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < 32; ++i) idx.push_back(s * 32 + i);
    auto b = task->train_batch(idx);
    auto logits = model->forward(b.x);
    engine.backward(torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, 10}), b.y.view({-1}),
                                                         torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1)));
    engine.step();
  }
  const auto device = engine.model_state_bytes(zero::Tier::kDevice);
  EXPECT_EQ(device.parameters, zero::partition::FlatParameters::padded_size(outside, 1) * 2);
  EXPECT_EQ(device.parameters, 3584);
  EXPECT_EQ(device.gradients, 0);
  EXPECT_EQ(device.optimizer_states, 0);
}

}  // namespace
