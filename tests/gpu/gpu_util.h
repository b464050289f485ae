// What the gpu tests share (gpu_test.cpp, gpu_optim_test.cpp,
// gpu_tools_test.cpp): the skip without CUDA, a tiny minGPT, the engine's
// loop on the card, temporary folders and running programs.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include "data.h"
#include "model.h"
#include "zero/runtime/engine_internal.h"
#include "zero/zero.h"

#define REQUIRE_CUDA()                                                                                 \
  do {                                                                                                 \
    if (!torch::cuda::is_available())                                                                  \
      GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false); this test runs on the " \
                      "GPU machine: scripts/gpu/run.sh test";                                          \
  } while (0)

namespace zero_gpu_test {


inline const torch::Device kCuda(torch::kCUDA, 0);
inline const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";

inline mingpt::GPTConfig gpt(double dropout = 0.0) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = dropout;
  return c;
}

inline torch::Tensor loss_of(mingpt::GPT& model, const mingpt::Batch& b) {
  auto logits = model->forward(b.x.to(kCuda));
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                              b.y.to(kCuda).view({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

inline mingpt::Batch batch(const mingpt::Task& task, int step, int64_t size = 32) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < size; ++i) idx.push_back((step * size + i) % task.train_size());
  return task.train_batch(idx);
}

inline double norm_of(mingpt::GPT& model) {
  double s = 0;
  for (auto& p : model->parameters()) s += p.detach().to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(s);
}

inline double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

constexpr int kSteps = 10;

// The plain LibTorch loop: AdamW and clip_grad_norm_ on CUDA, in fp32.
inline double plain_loop(double dropout = 0.0) {
  torch::manual_seed(3);
  mingpt::GPT model(gpt(dropout));
  model->to(kCuda);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  auto task = mingpt::make_addition_task(2);
  torch::manual_seed(9);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    loss_of(model, batch(*task, s)).backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
  }
  return norm_of(model);
}

struct RunResult {
  double l2 = 0;
  std::vector<double> losses;
  int64_t device_state_bytes = -1;  // model states on the device tier after the last step
  zero::ModelStateBytes device_states;
  zero::detail::SpeculationCounts speculation;  // super_offload's (NOTE [speculative step])
  // NOTE [frozen groups]: frozen parameters after the last step, by tier.
  int64_t frozen_device = 0, frozen_pinned = 0, frozen_nvme = 0;
};

// The same through zero with `zero` (the zero_optimization section) and `extra` top-level keys.
// `options` (may be null) changes the InitOptions (InitOptions::trainable, say).
inline RunResult engine_loop(const std::string& zero, const std::string& extra = "", bool checkpoint = false,
                      double dropout = 0.0, double clip = 1.0,
                      const std::function<void(zero::InitOptions&)>& options = {}) {
  torch::manual_seed(3);
  mingpt::GPT model(gpt(dropout));
  zero::InitOptions o;
  o.print_progress = false;
  o.device = kCuda;
  if (options) options(o);
  const std::string config = R"({"train_micro_batch_size_per_gpu": 32, "gradient_clipping": )" + std::to_string(clip) +
                             R"(, )"
                             R"("optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], )"
                             R"("eps": 1e-8, "weight_decay": 0.01}}, )" +
                             extra + R"("zero_optimization": {)" + zero + "}}";
  auto engine = zero::initialize(model.ptr(), config, o);
  if (checkpoint) model->set_checkpointer(&engine.checkpointer());
  auto task = mingpt::make_addition_task(2);
  torch::manual_seed(9);
  RunResult r;
  for (int s = 0; s < kSteps; ++s) {
    auto loss = loss_of(model, batch(*task, s));
    r.losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  r.l2 = engine.parameter_l2();
  r.device_states = engine.model_state_bytes(zero::Tier::kDevice);
  r.device_state_bytes = r.device_states.total();
  r.speculation = zero::detail::speculation_counts(engine);
  r.frozen_device = engine.ledger().get(zero::Tier::kDevice, zero::Kind::kFrozenParameters).current_bytes;
  r.frozen_pinned = engine.ledger().get(zero::Tier::kPinnedHost, zero::Kind::kFrozenParameters).current_bytes;
  r.frozen_nvme = engine.ledger().get(zero::Tier::kNvme, zero::Kind::kFrozenParameters).current_bytes;
  return r;
}

inline std::string nvme_dir(const std::string& name) {
  const std::string d = std::string(ZERO_BINARY_DIR) + "/tests/gpu_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::create_directories(d);
  return d;
}


inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

inline int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}


}  // namespace zero_gpu_test
