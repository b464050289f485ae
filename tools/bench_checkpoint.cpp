// zero bench checkpoint: activation memory and step time of minGPT with and
// without activation checkpointing, and with cpu_checkpointing.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "bench.h"
#include "model.h"
#include "zero/core/ledger_alloc.h"
#include "zero/checkpointing/checkpoint.h"
#include "zero/core/memory_ledger.h"

namespace zero::tools {

int bench_checkpoint(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--n_layer", 8},     {"--n_embd", 256}, {"--n_head", 8},
                                         {"--block_size", 128}, {"--batch_size", 16}, {"--steps", 5}};
  std::string json_path;
  if (!parse_bench_options("zero bench checkpoint", args, ints, json_path)) return 2;
  install_counting_cpu_allocator();
  mingpt::GPTConfig g;
  g.n_layer = ints["--n_layer"];
  g.n_embd = ints["--n_embd"];
  g.n_head = ints["--n_head"];
  g.block_size = ints["--block_size"];
  g.vocab_size = 65;
  const int64_t B = ints["--batch_size"], T = g.block_size, steps = ints["--steps"];
  torch::manual_seed(0);
  auto x = torch::randint(0, g.vocab_size, {B, T}, torch::kLong);
  auto y = torch::randint(0, g.vocab_size, {B, T}, torch::kLong);

  struct Mode {
    const char* label;
    bool checkpoint;
    bool cpu;
  };
  const Mode modes[] = {{"no checkpointing", false, false},
                        {"checkpoint every block", true, false},
                        {"checkpoint + cpu_checkpointing", true, true}};
  struct Result {
    double activation_peak_bytes, kept_device_bytes, kept_host_bytes, step_ms;
  };
  std::vector<Result> results;
  for (const auto& mode : modes) {
    torch::manual_seed(1);
    mingpt::GPT model(g);
    model->train();
    config::ActivationCheckpointingConfig cfg;
    cfg.cpu_checkpointing = mode.cpu;
    MemoryLedger ledger;
    checkpointing::Checkpointer ckpt(cfg, &ledger);
    if (mode.checkpoint) model->set_checkpointer(&ckpt);
    auto step = [&] {
      auto logits = model->forward(x);
      auto loss = torch::nn::functional::cross_entropy(logits.view({-1, g.vocab_size}), y.view({-1}));
      loss.backward();
      ckpt.end_micro_step();
    };
    step();  // gradients now exist, so later steps allocate only activations
    std::vector<double> ms;
    double peak = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t base = cpu_allocator_stats().current_bytes;
      reset_cpu_allocator_peak();
      ledger.reset_peaks();
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      peak = std::max(peak, static_cast<double>(cpu_allocator_stats().peak_bytes - base));
    }
    std::sort(ms.begin(), ms.end());
    results.push_back({peak, static_cast<double>(ledger.get(Tier::kDevice, Kind::kActivations).peak_bytes),
                       static_cast<double>(ledger.get(Tier::kHost, Kind::kActivations).peak_bytes +
                                           ledger.get(Tier::kPinnedHost, Kind::kActivations).peak_bytes),
                       ms[ms.size() / 2]});
  }
  const double mib = 1024.0 * 1024.0;
  std::printf("zero bench checkpoint: minGPT L=%lld C=%lld T=%lld (%lld parameters), batch %lld, fp32, CPU; median of %lld steps\n",
              static_cast<long long>(g.n_layer), static_cast<long long>(g.n_embd), static_cast<long long>(T),
              static_cast<long long>(g.num_parameters()), static_cast<long long>(B), static_cast<long long>(steps));
  std::printf("  %-32s %18s %18s %16s %10s\n", "", "activation peak", "kept on device", "kept on host", "ms/step");
  for (size_t i = 0; i < results.size(); ++i)
    std::printf("  %-32s %14.1f MiB %14.1f MiB %12.1f MiB %10.1f\n", modes[i].label,
                results[i].activation_peak_bytes / mib, results[i].kept_device_bytes / mib,
                results[i].kept_host_bytes / mib, results[i].step_ms);
  const double cut = results[0].activation_peak_bytes / results[1].activation_peak_bytes;
  const double cost = results[1].step_ms / results[0].step_ms;
  std::printf("  activation peak, none / checkpointed: %.2fx; step time, checkpointed / none: %.2f\n", cut, cost);
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "checkpoint"}, {"n_layer", g.n_layer}, {"num_parameters", g.num_parameters()}};
    const char* keys[] = {"none", "checkpoint", "cpu_checkpointing"};
    for (size_t i = 0; i < results.size(); ++i) {
      j[keys[i]] = {{"activation_peak_bytes", results[i].activation_peak_bytes},
                    {"kept_device_bytes", results[i].kept_device_bytes},
                    {"kept_host_bytes", results[i].kept_host_bytes},
                    {"step_ms", results[i].step_ms}};
    }
    j["activation_peak_ratio_none_vs_checkpoint"] = cut;
    j["step_time_ratio_checkpoint_vs_none"] = cost;
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
