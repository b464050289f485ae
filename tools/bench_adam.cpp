// zero bench adam: zero's CPU Adam against LibTorch's torch::optim::Adam and
// against the machine's memory bandwidth (a stream triad), on the same sizes,
// in one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>
#include <tbb/task_arena.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "bench.h"
#include "zero/optim/flat_optimizer.h"

namespace zero::tools {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int bench_adam(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--numel", 100000000}, {"--steps", 5}};
  std::string json_path;
  if (!parse_bench_options("zero bench adam", args, ints, json_path)) return 2;
  const int64_t n = ints["--numel"], steps = ints["--steps"];
  torch::manual_seed(0);
  auto param = torch::randn({n});
  auto grad = torch::randn({n}) * 0.01;
  std::vector<at::Tensor> states{torch::zeros({n}), torch::zeros({n})};

  config::OptimizerConfig cfg;
  cfg.type = config::OptimizerType::kAdam;
  cfg.adam_w_mode = false;  // torch::optim::Adam's L2 decay, so both do the same math
  cfg.weight_decay = 0.01;
  auto ours = optim::FlatOptimizer::create(cfg);
  std::vector<double> ours_s;
  for (int64_t s = 0; s <= steps; ++s) {
    const auto t0 = Clock::now();
    ours->update({s + 1, 1e-3, 0.9, 0.999}, param, grad, states);
    if (s > 0) ours_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());  // step 0 warms up
  }

  auto ref = torch::randn({n}).requires_grad_(true);
  ref.mutable_grad() = grad.clone();
  torch::optim::Adam torch_adam(std::vector<torch::Tensor>{ref}, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
  std::vector<double> torch_s;
  for (int64_t s = 0; s <= steps; ++s) {
    const auto t0 = Clock::now();
    torch_adam.step();
    if (s > 0) torch_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ref = torch::Tensor();

  // Stream triad a = b + s * c over n floats, split like the kernel: the
  // bandwidth this machine gives a streaming loop. Counted as 16 bytes per
  // element, not STREAM's 12: writing `a` without reading it first makes the
  // CPU read it in (write-allocate), whereas the Adam pass writes only arrays
  // it has just read, so its 28 bytes are the real traffic.
  float* a = param.data_ptr<float>();
  const float* b = grad.data_ptr<float>();
  const float* c = states[0].data_ptr<float>();
  std::vector<double> triad_s;
  for (int64_t s = 0; s <= steps; ++s) {
    const auto t0 = Clock::now();
    optim::stream_triad(a, b, c, 0.5f, n);
    if (s > 0) triad_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double t_ours = median(ours_s), t_torch = median(torch_s), t_triad = median(triad_s);
  const double ours_pps = n / t_ours, torch_pps = n / t_torch;
  const double bytes_per_param = 28.0;  // read param, grad, exp_avg, exp_avg_sq; write three of them
  const double ours_bw = bytes_per_param * n / t_ours;
  const double triad_bw = 16.0 * n / t_triad;
  std::printf("zero bench adam: %lld fp32 parameters, %s kernel, %d threads (oneTBB); median of %lld steps\n",
              static_cast<long long>(n), optim::cpu_adam_isa(), tbb::this_task_arena::max_concurrency(),
              static_cast<long long>(steps));
  std::printf("  %-34s %16s %14s\n", "", "params/s", "GB/s");
  std::printf("  %-34s %16.3e %14.2f\n", "zero CPU Adam (fused, one pass)", ours_pps, ours_bw / 1e9);
  std::printf("  %-34s %16.3e %14s\n", "torch::optim::Adam", torch_pps, "");
  std::printf("  %-34s %16s %14.2f\n", "stream triad (16 B/element)", "", triad_bw / 1e9);
  std::printf("  ratio zero/torch: %.2fx; zero's bytes/s as a fraction of the triad bandwidth: %.2f\n",
              ours_pps / torch_pps, ours_bw / triad_bw);
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "adam"},
                        {"numel", n},
                        {"isa", optim::cpu_adam_isa()},
                        {"ours_params_per_s", ours_pps},
                        {"torch_params_per_s", torch_pps},
                        {"ours_bytes_per_s", ours_bw},
                        {"triad_bytes_per_s", triad_bw},
                        {"ratio_vs_torch", ours_pps / torch_pps},
                        {"bandwidth_fraction", ours_bw / triad_bw}};
    std::ofstream(json_path) << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace zero::tools
