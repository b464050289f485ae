#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "bench.h"
#include "data.h"
#include "model.h"
#include "zero/zero.h"

namespace zero::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::map<std::string, int64_t> ints = {{"--n_layer", 4},   {"--n_head", 4}, {"--n_embd", 256},
                                         {"--batch_size", 32}, {"--steps", 20}, {"--rounds", 3}};
  std::string json;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

torch::Tensor loss_of(mingpt::GPT& model, const mingpt::Batch& b) {
  auto logits = model->forward(b.x);
  return torch::nn::functional::cross_entropy(
      logits.view({-1, logits.size(-1)}), b.y.view({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

}  // namespace

int bench_engine(const std::vector<std::string>& args) {
  Options o;
  if (!parse_bench_options("zero bench engine", args, o.ints, o.json)) return 2;
  mingpt::GPTConfig g;
  g.n_layer = o.ints["--n_layer"];
  g.n_head = o.ints["--n_head"];
  g.n_embd = o.ints["--n_embd"];
  g.vocab_size = 10;
  g.block_size = 6;
  g.embd_pdrop = g.resid_pdrop = g.attn_pdrop = 0.0;
  const int64_t batch = o.ints["--batch_size"], steps = o.ints["--steps"], rounds = o.ints["--rounds"];
  auto task = mingpt::make_addition_task(2);
  auto order = mingpt::epoch_order(task->train_size(), 1, 0);
  std::vector<mingpt::Batch> batches;
  for (int64_t s = 0; s < steps + 1; ++s)
    batches.push_back(task->train_batch(mingpt::micro_batch_indices(order, s, 0, 0, batch, 1, 1)));

  torch::manual_seed(0);
  mingpt::GPT ref_model(g);
  torch::optim::AdamW ref_opt(ref_model->parameters(),
                              torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1));
  torch::manual_seed(0);
  mingpt::GPT our_model(g);
  InitOptions io;
  io.print_progress = false;
  io.device = torch::Device(torch::kCPU);
  auto engine = initialize(our_model.ptr(),
                           "{\"train_micro_batch_size_per_gpu\": " + std::to_string(batch) +
                               ", \"gradient_clipping\": 1.0, \"optimizer\": {\"type\": \"AdamW\", "
                               "\"params\": {\"lr\": 1e-3, \"betas\": [0.9, 0.95], \"weight_decay\": 0.1}}}",
                           io);

  auto torch_step = [&](const mingpt::Batch& b) {
    ref_opt.zero_grad();
    loss_of(ref_model, b).backward();
    torch::nn::utils::clip_grad_norm_(ref_model->parameters(), 1.0);
    ref_opt.step();
  };
  auto our_step = [&](const mingpt::Batch& b) {
    engine.backward(loss_of(our_model, b));
    engine.step();
  };
  // One untimed step each (allocations, first-touch), then alternating timed rounds.
  torch_step(batches[0]);
  our_step(batches[0]);
  std::vector<double> torch_ms, our_ms;
  for (int64_t r = 0; r < rounds; ++r) {
    for (int which = 0; which < 2; ++which) {
      const auto t0 = Clock::now();
      for (int64_t s = 1; s <= steps; ++s) {
        if (which == 0) torch_step(batches[s]);
        else our_step(batches[s]);
      }
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / steps;
      (which == 0 ? torch_ms : our_ms).push_back(ms);
    }
  }
  const double t_torch = median(torch_ms), t_ours = median(our_ms);
  const double ratio = t_torch / t_ours;
  const int64_t params = g.num_parameters();
  std::printf("zero bench engine: minGPT L=%lld C=%lld (%lld parameters), batch %lld, fp32, CPU, "
              "%lld threads; median of %lld rounds of %lld steps\n",
              static_cast<long long>(g.n_layer), static_cast<long long>(g.n_embd),
              static_cast<long long>(params), static_cast<long long>(batch),
              static_cast<long long>(torch::get_num_threads()), static_cast<long long>(rounds),
              static_cast<long long>(steps));
  std::printf("  %-34s %12s %14s\n", "", "ms/step", "steps/s");
  std::printf("  %-34s %12.2f %14.2f\n", "LibTorch loop (AdamW + clip)", t_torch, 1e3 / t_torch);
  std::printf("  %-34s %12.2f %14.2f\n", "zero engine, stage 0", t_ours, 1e3 / t_ours);
  std::printf("  ratio zero/LibTorch (throughput): %.3f\n", ratio);
  if (!o.json.empty()) {
    nlohmann::json j = {{"benchmark", "engine"},       {"num_parameters", params},
                        {"batch_size", batch},         {"n_layer", g.n_layer},
                        {"n_embd", g.n_embd},          {"threads", torch::get_num_threads()},
                        {"torch_step_ms", t_torch},    {"ours_step_ms", t_ours},
                        {"torch_steps_per_s", 1e3 / t_torch}, {"ours_steps_per_s", 1e3 / t_ours},
                        {"ratio_vs_torch", ratio}};
    write_json_output(o.json, j);
  }
  return 0;
}

}  // namespace zero::tools
