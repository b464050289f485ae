// Activation checkpointing against the same computation without it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "data.h"
#include "model.h"
#include "zero/checkpointing/checkpoint.h"
#include "zero/core/comm.h"
#include "zero/core/error.h"

namespace {

using zero::checkpointing::Checkpointer;
using Cfg = zero::config::ActivationCheckpointingConfig;

mingpt::GPTConfig gpt(int64_t layers = 3) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = layers;
  c.n_head = 2;
  c.n_embd = 32;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0.1;  // dropout on: masks must repeat
  return c;
}

// Gradients of every parameter after one forward/backward, with the global
// RNG seeded the same way before the model and before the forward.
std::vector<torch::Tensor> grads_of(Checkpointer* ckpt, const mingpt::Batch& b, uint64_t seed = 3) {
  torch::manual_seed(seed);
  mingpt::GPT model(gpt());
  model->train();
  model->set_checkpointer(ckpt);
  torch::manual_seed(seed + 1);
  auto logits = model->forward(b.x);
  auto loss = torch::nn::functional::cross_entropy(
      logits.view({-1, 10}), b.y.view({-1}), torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
  loss.backward();
  if (ckpt) ckpt->end_micro_step();
  std::vector<torch::Tensor> g;
  for (auto& p : model->parameters()) g.push_back(p.grad().clone());
  return g;
}

double max_rel(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-12);
    m = std::max(m, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return m;
}

mingpt::Batch batch() {
  auto task = mingpt::make_addition_task(2);
  return task->train_batch({0, 1, 2, 3, 4, 5, 6, 7});
}

TEST(Checkpoint, MinGptGradientsMatchWithDropout) {
  auto b = batch();
  auto reference = grads_of(nullptr, b);
  Checkpointer ckpt(Cfg{});
  auto checkpointed = grads_of(&ckpt, b);
  EXPECT_LT(max_rel(checkpointed, reference), 1e-6);
  // and dropout really was on: another seed gives other gradients.
  EXPECT_GT(max_rel(grads_of(nullptr, b, 99), reference), 1e-3);
}

TEST(Checkpoint, SeveralInputsAndOutputsNonDifferentiableAndNoGradInputs) {
  auto x = torch::randn({4, 3}, torch::requires_grad());
  auto y = torch::randn({4, 3}, torch::requires_grad());
  auto frozen = torch::randn({4, 3});  // does not require grad
  auto ids = torch::arange(4);          // integer input
  auto fn = [](const std::vector<torch::Tensor>& in) {
    auto a = (in[0] * in[1] + in[2]).tanh();
    auto s = (in[0] + in[1]).pow(2).sum();
    auto idx = in[3] + 1;  // integer output: not differentiable
    return std::vector<torch::Tensor>{a, s, idx};
  };
  auto direct = fn({x, y, frozen, ids});
  (direct[0].sum() * 2 + direct[1]).backward();
  auto gx = x.grad().clone(), gy = y.grad().clone();
  x.mutable_grad().reset();
  y.mutable_grad().reset();

  auto out = zero::checkpointing::checkpoint(fn, {x, y, frozen, ids});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[0].requires_grad());
  EXPECT_FALSE(out[2].requires_grad());
  EXPECT_TRUE(torch::equal(out[2], ids + 1));
  (out[0].sum() * 2 + out[1]).backward();
  EXPECT_TRUE(torch::allclose(x.grad(), gx, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(y.grad(), gy, 1e-6, 1e-7));
  EXPECT_FALSE(frozen.grad().defined());
}

TEST(Checkpoint, CallersRandomStateIsUnchangedByTheRecompute) {
  auto x = torch::randn({64}, torch::requires_grad());
  auto y = zero::checkpointing::checkpoint(
      [](const torch::Tensor& t) { return torch::dropout(t, 0.5, /*train=*/true); }, x);
  auto before = at::detail::getDefaultCPUGenerator().get_state();
  y.sum().backward();
  auto after = at::detail::getDefaultCPUGenerator().get_state();
  EXPECT_TRUE(torch::equal(before, after)) << "backward moved the caller's RNG";
  // The recompute drew the forward's mask: the gradient is 2 where y kept x, else 0.
  auto kept = (y != 0).to(torch::kFloat);
  EXPECT_TRUE(torch::allclose(x.grad(), kept * 2.0));
}

TEST(Checkpoint, CpuCheckpointingEqualsOnDeviceAndLivesOnTheHostTier) {
  auto b = batch();
  Checkpointer on_device(Cfg{});
  auto reference = grads_of(&on_device, b);
  Cfg cfg;
  cfg.cpu_checkpointing = true;
  zero::MemoryLedger ledger;
  Checkpointer host(cfg, &ledger);
  auto got = grads_of(&host, b);
  EXPECT_LT(max_rel(got, reference), 1e-6);
  const auto host_peak = ledger.get(zero::Tier::kHost, zero::Kind::kActivations).peak_bytes;
  EXPECT_EQ(host_peak, 3 * 8 * 6 * 32 * 4) << "the three blocks' inputs, fp32";
  EXPECT_EQ(ledger.get(zero::Tier::kDevice, zero::Kind::kActivations).peak_bytes, 0);
  EXPECT_EQ(ledger.get(zero::Tier::kHost, zero::Kind::kActivations).current_bytes, 0) << "freed after backward";
}

TEST(Checkpoint, ContiguousBufferGivesTheSameGradientsAndIsReused) {
  auto b = batch();
  Checkpointer plain(Cfg{});
  auto reference = grads_of(&plain, b);
  Cfg cfg;
  cfg.contiguous_memory_optimization = true;
  cfg.number_checkpoints = 3;
  zero::MemoryLedger ledger;
  Checkpointer contiguous(cfg, &ledger);
  EXPECT_LT(max_rel(grads_of(&contiguous, b), reference), 1e-6);
  EXPECT_LT(max_rel(grads_of(&contiguous, b), reference), 1e-6) << "second micro-step reuses the slots";
  EXPECT_EQ(ledger.get(zero::Tier::kDevice, zero::Kind::kActivations).current_bytes, 3 * 8 * 6 * 32 * 4);
}

TEST(Checkpoint, TooFewContiguousSlotsNameTheKey) {
  Cfg cfg;
  cfg.contiguous_memory_optimization = true;
  cfg.number_checkpoints = 2;
  Checkpointer ckpt(cfg);
  try {
    grads_of(&ckpt, batch());
    FAIL() << "three checkpoints in two slots";
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("activation_checkpointing.number_checkpoints"), std::string::npos)
        << e.what();
  }
  Cfg missing;
  missing.contiguous_memory_optimization = true;
  EXPECT_THROW(Checkpointer{missing}, zero::ConfigError);
}

// partition_activations on two real ranks: each rank keeps half of every
// input, and the gradients equal the unpartitioned ones. The test re-runs this
// binary as the two ranks (CheckpointWorker below).
TEST(Checkpoint, PartitionedOnTwoRanksEqualsUnpartitioned) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(n, 0);
  self[n] = '\0';
  const std::string log = std::string(ZERO_BINARY_DIR) + "/tests/checkpoint_partition_" + std::to_string(getpid()) + ".log";
  const std::string cmd = "ZERO_CHECKPOINT_WORKER=1 OMP_NUM_THREADS=1 " + std::string(ZERO_BINARY_DIR) +
                          "/bin/zero launch --nproc_per_node 2 -- " + self +
                          " --gtest_filter=CheckpointWorker.PartitionedEqualsWhole > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("[rank 1] [  PASSED  ] 1 test"), std::string::npos) << text;
}

TEST(CheckpointWorker, PartitionedEqualsWhole) {
  if (std::getenv("ZERO_CHECKPOINT_WORKER") == nullptr) GTEST_SKIP() << "runs as a rank of the test above";
  auto comm = zero::Comm::connect(zero::DistEnv::from_environment(), at::kCPU);
  auto b = batch();  // the same batch on both ranks: a model-parallel group's ranks hold the same activations
  Checkpointer whole(Cfg{});
  auto reference = grads_of(&whole, b);
  Cfg cfg;
  cfg.partition_activations = true;
  zero::MemoryLedger ledger;
  Checkpointer part(cfg, &ledger, comm.get());
  ASSERT_TRUE(part.partitioning());
  auto got = grads_of(&part, b);
  EXPECT_LT(max_rel(got, reference), 1e-6);
  EXPECT_EQ(ledger.get(zero::Tier::kDevice, zero::Kind::kActivations).peak_bytes, 3 * 8 * 6 * 32 * 4 / 2)
      << "each rank keeps half of each input";
}

}  // namespace
