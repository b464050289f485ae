// zero bench adam: zero's CPU AdamW against at::_fused_adamw_ (what
// torch.optim.AdamW(fused=True) runs on the CPU), its Adam against
// torch::optim::Adam, and both against the machine's memory bandwidth (a pass
// with Adam's traffic and no math, and the STREAM triad), on the same sizes,
// in one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>

#include <nlohmann/json.hpp>
#include <tbb/task_arena.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/Parallel.h>
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
  const auto param0 = torch::randn({n});
  const auto grad = torch::randn({n}) * 0.01;
  constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kWd = 0.01, kEps = 1e-8;
  // Every variant runs once per round, in turn (the order rotating), so that a machine whose
  // memory speed drifts (a shared host) treats them alike; round 0 warms up
  // (first touch of the pages) and is not counted; medians are reported.
  struct Variant {
    std::function<void(int64_t)> run;  // takes the 1-based step
    std::vector<double> seconds;
  };
  std::vector<Variant> variants;
  auto add = [&](std::function<void(int64_t)> fn) {
    variants.push_back({std::move(fn), {}});
    return variants.size() - 1;
  };
  auto ours_with = [&](bool adam_w, at::Tensor& param, std::vector<at::Tensor>& states) {
    config::OptimizerConfig cfg;
    cfg.type = config::OptimizerType::kAdam;
    cfg.adam_w_mode = adam_w;
    cfg.weight_decay = kWd;
    cfg.eps = kEps;
    std::shared_ptr<optim::FlatOptimizer> opt = optim::FlatOptimizer::create(cfg);
    return add([&, opt](int64_t step) { opt->update({step, kLr, kBeta1, kBeta2}, param, grad, states); });
  };

  // Adam with L2 decay: ours against torch::optim::Adam (LibTorch's loop).
  auto param = param0.clone();
  std::vector<at::Tensor> states{torch::zeros({n}), torch::zeros({n})};
  const size_t v_ours_l2 = ours_with(false, param, states);
  auto ref = param0.clone().requires_grad_(true);
  ref.mutable_grad() = grad.clone();
  torch::optim::Adam torch_adam(std::vector<torch::Tensor>{ref}, torch::optim::AdamOptions(kLr).weight_decay(kWd));
  const size_t v_torch = add([&](int64_t) { torch_adam.step(); });

  // AdamW: ours against at::_fused_adamw_, what torch.optim.AdamW(fused=True)
  // runs on the CPU, on the same data; the two results are compared too.
  auto ours_p = param0.clone();
  std::vector<at::Tensor> ours_st{torch::zeros({n}), torch::zeros({n})};
  const size_t v_ours_w = ours_with(true, ours_p, ours_st);
  auto fused_p = param0.clone(), fused_m = torch::zeros({n}), fused_v = torch::zeros({n});
  auto fused_step = torch::zeros({}, torch::kFloat);
  const size_t v_fused = add([&](int64_t) {
    fused_step.add_(1);  // as torch.optim.AdamW does before the fused call (the kernel reads, not counts, it)
    at::_fused_adamw_({fused_p}, {grad}, {fused_m}, {fused_v}, {}, {fused_step}, kLr, kBeta1, kBeta2, kWd, kEps,
                      /*amsgrad=*/false, /*maximize=*/false);
  });

  // AdamW over 8-bit states (optimizer.params.optim_bits 8) on the same data.
  auto q8_p = param0.clone();
  const int64_t q8_blocks = (n + 255) / 256;
  std::vector<at::Tensor> q8_st{torch::zeros({n}, torch::kUInt8), torch::zeros({q8_blocks}),
                                torch::zeros({n}, torch::kUInt8), torch::zeros({q8_blocks})};
  config::OptimizerConfig q8_cfg;
  q8_cfg.type = config::OptimizerType::kAdamW;
  q8_cfg.weight_decay = kWd;
  q8_cfg.eps = kEps;
  q8_cfg.optim_bits = 8;
  std::shared_ptr<optim::FlatOptimizer> q8_opt = optim::FlatOptimizer::create(q8_cfg);
  const size_t v_q8 = add([&](int64_t step) { q8_opt->update({step, kLr, kBeta1, kBeta2}, q8_p, grad, q8_st); });

  // AdamW with a bf16 master and bf16 states (bf16_master_weights_and_grads
  // + bf16_optimizer_states, NOTE [16-bit master]), stochastically rounded.
  auto b16_p = param0.to(torch::kBFloat16);
  std::vector<at::Tensor> b16_st{torch::zeros({n}, torch::kBFloat16), torch::zeros({n}, torch::kBFloat16)};
  config::OptimizerConfig b16_cfg = q8_cfg;
  b16_cfg.optim_bits = 32;
  b16_cfg.bf16_states = true;
  std::shared_ptr<optim::FlatOptimizer> b16_opt = optim::FlatOptimizer::create(b16_cfg);
  const size_t v_b16 = add([&](int64_t step) {
    optim::FlatOptimizer::Run run{0, n, {step, kLr, kBeta1, kBeta2}};
    optim::update_stored(*b16_opt, {run}, b16_p, grad, b16_st, nullptr, optim::Rounding{true, 0, step});
  });
  // The same as training runs it: bf16_master_weights_and_grads keeps the
  // gradients in bf16 too (widened a window at a time in the pass).
  auto b16g_p = param0.to(torch::kBFloat16);
  std::vector<at::Tensor> b16g_st{torch::zeros({n}, torch::kBFloat16), torch::zeros({n}, torch::kBFloat16)};
  const at::Tensor grad16 = grad.to(torch::kBFloat16);
  const size_t v_b16g = add([&](int64_t step) {
    optim::FlatOptimizer::Run run{0, n, {step, kLr, kBeta1, kBeta2}};
    optim::update_stored(*b16_opt, {run}, b16g_p, grad16, b16g_st, nullptr, optim::Rounding{true, 0, step});
  });

  // The arithmetic alone: one thread over a slice that stays in its cache
  // (16384 elements, 64 8-bit blocks: below both kernels' grain, so no
  // second thread), fp32 states against 8-bit, kInCacheReps passes a round.
  // Where this ratio is near 1 the 8-bit pass is memory-bound.
  constexpr int64_t kInCache = 16384, kInCacheReps = 64;
  const auto c_param0 = torch::randn({kInCache}), c_grad = torch::randn({kInCache}) * 0.01;
  auto c32_p = c_param0.clone(), c8_p = c_param0.clone();
  std::vector<at::Tensor> c32_st{torch::zeros({kInCache}), torch::zeros({kInCache})};
  std::vector<at::Tensor> c8_st{torch::zeros({kInCache}, torch::kUInt8), torch::zeros({kInCache / 256}),
                                torch::zeros({kInCache}, torch::kUInt8), torch::zeros({kInCache / 256})};
  config::OptimizerConfig c32_cfg = q8_cfg;
  c32_cfg.optim_bits = 32;
  std::shared_ptr<optim::FlatOptimizer> c32_opt = optim::FlatOptimizer::create(c32_cfg);
  const size_t v_c32 = add([&](int64_t step) {
    for (int64_t r = 0; r < kInCacheReps; ++r) c32_opt->update({step, kLr, kBeta1, kBeta2}, c32_p, c_grad, c32_st);
  });
  const size_t v_c8 = add([&](int64_t step) {
    for (int64_t r = 0; r < kInCacheReps; ++r) q8_opt->update({step, kLr, kBeta1, kBeta2}, c8_p, c_grad, c8_st);
  });

  // The offloaded step's gradient (NOTE [16-bit gradients]): an fp32 master
  // and fp32 states, the gradient unscaled by the step's factor. fp32 as the
  // step takes it (unscaled in a pass of its own, then Adam: 8 + 28 bytes an
  // element) and unscaled inside the pass (28); bf16 widened and unscaled
  // first, as the 16-bit path did (6 + 8 + 28), and inside the pass (26).
  constexpr float kUnscale = 1.0f / 3000.0f;
  config::OptimizerConfig g_cfg = q8_cfg;
  g_cfg.optim_bits = 32;
  std::shared_ptr<optim::FlatOptimizer> g_opt = optim::FlatOptimizer::create(g_cfg);
  auto g32_p = param0.clone(), g32p_p = param0.clone(), g16f_p = param0.clone(), g16p_p = param0.clone();
  std::vector<at::Tensor> g32_st{torch::zeros({n}), torch::zeros({n})}, g32p_st{torch::zeros({n}), torch::zeros({n})},
      g16f_st{torch::zeros({n}), torch::zeros({n})}, g16p_st{torch::zeros({n}), torch::zeros({n})};
  auto unscaled = torch::empty({n});
  const size_t v_g32 = add([&](int64_t step) {
    at::mul_out(unscaled, grad, kUnscale);
    g_opt->update({step, kLr, kBeta1, kBeta2}, g32_p, unscaled, g32_st);
  });
  const size_t v_g32_pass = add([&](int64_t step) {
    optim::FlatOptimizer::Run run{0, n, {step, kLr, kBeta1, kBeta2}};
    optim::update_stored(*g_opt, {run}, g32p_p, grad, g32p_st, nullptr, optim::Rounding{false, 0, step}, kUnscale);
  });
  const size_t v_g16_first = add([&](int64_t step) {
    const at::Tensor g = grad16.to(torch::kFloat).mul_(kUnscale);
    g_opt->update({step, kLr, kBeta1, kBeta2}, g16f_p, g, g16f_st);
  });
  const size_t v_g16_pass = add([&](int64_t step) {
    optim::FlatOptimizer::Run run{0, n, {step, kLr, kBeta1, kBeta2}};
    optim::update_stored(*g_opt, {run}, g16p_p, grad16, g16p_st, nullptr, optim::Rounding{false, 0, step}, kUnscale);
  });

  // The memory's speed: a pass with Adam's traffic and no arithmetic to speak
  // of (stream_adam_pattern: four arrays read, three written back, 28 bytes
  // per element, counted as Adam's are), and for reference the STREAM triad
  // a = b + s * c (16 bytes with the write-allocate read of a).
  std::vector<at::Tensor> pattern{torch::zeros({n}), torch::zeros({n}), torch::zeros({n})};
  const size_t v_pattern = add([&](int64_t) {
    optim::stream_adam_pattern(pattern[0].data_ptr<float>(), grad.data_ptr<float>(), pattern[1].data_ptr<float>(),
                               pattern[2].data_ptr<float>(), 1e-9f, n);
  });
  const size_t v_triad = add([&](int64_t) {
    optim::stream_triad(pattern[0].data_ptr<float>(), grad.data_ptr<float>(), pattern[1].data_ptr<float>(), 0.5f, n);
  });

  // The gradient norm each step takes (NOTE [gradient norm]): zero's fp64
  // sum of squares against ATen's fp32 norm of the same gradient.
  double norm_sink = 0;
  const size_t v_norm = add([&](int64_t) { norm_sink += optim::sum_of_squares_fp64(grad.data_ptr<float>(), n); });
  const size_t v_norm16 = add([&](int64_t) {
    norm_sink += optim::sum_of_squares_fp64(static_cast<const uint16_t*>(grad16.data_ptr()), n, /*bf16=*/true);
  });
  const size_t v_norm_aten = add([&](int64_t) {
    norm_sink += at::linalg_vector_norm(grad, 2, c10::nullopt, false, at::kFloat).item<double>();
  });

  for (int64_t round = 0; round <= steps; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {  // who goes first rotates
      auto& v = variants[(k + static_cast<size_t>(round)) % variants.size()];
      const auto t0 = Clock::now();
      v.run(round + 1);
      if (round > 0) v.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  auto t = [&](size_t v) { return median(variants[v].seconds); };
  const double t_ours_l2 = t(v_ours_l2), t_torch = t(v_torch), t_ours_w = t(v_ours_w), t_fused = t(v_fused);
  const double t_pattern = t(v_pattern), t_triad = t(v_triad), t_norm = t(v_norm), t_norm_aten = t(v_norm_aten);
  const double t_q8 = t(v_q8), t_b16 = t(v_b16), t_b16g = t(v_b16g);
  const double c32_ns = t(v_c32) / (kInCache * kInCacheReps) * 1e9, c8_ns = t(v_c8) / (kInCache * kInCacheReps) * 1e9;
  const double t_g32 = t(v_g32), t_g32_pass = t(v_g32_pass), t_g16_first = t(v_g16_first), t_g16_pass = t(v_g16_pass), t_norm16 = t(v_norm16);
  // The same parameters whichever way the bf16 gradient was widened.
  const bool g16_same = torch::equal(g16f_p, g16p_p) && torch::equal(g16f_st[0], g16p_st[0]) && torch::equal(g16f_st[1], g16p_st[1]);
  const bool g32_same = torch::equal(g32_p, g32p_p) && torch::equal(g32_st[0], g32p_st[0]) && torch::equal(g32_st[1], g32p_st[1]);
  const double max_diff = (ours_p - fused_p).abs().max().item<double>();
  // How far 8-bit states moved the parameters from fp32 states, relative to how far fp32 moved them.
  const double q8_rel = ((q8_p - ours_p).norm() / (ours_p - param0).norm()).item<double>();
  if (norm_sink < 0) std::printf("\n");  // keeps the norms computed

  const double bytes_per_param = 28.0;
  const double ours_bw = bytes_per_param * n / t_ours_w, fused_bw = bytes_per_param * n / t_fused;
  const double pattern_bw = 28.0 * n / t_pattern, triad_bw = 16.0 * n / t_triad;
  // 8-bit states: param 4 + 4, grad 4, and the states (codes and block
  // scales, 2 + 8/256 bytes) read and written.
  const double q8_bytes_per_param = 12.0 + 2 * q8_opt->state_bytes_per_param();
  const double q8_bw = q8_bytes_per_param * n / t_q8;
  // bf16 master and states: master 2 + 2, grad 4, two moments 2 + 2 each.
  const double b16_bytes_per_param = 4.0 + 4.0 + 2 * b16_opt->state_bytes_per_param();
  const double b16_bw = b16_bytes_per_param * n / t_b16;
  // The mean update's error (a share of the mean update's size): how much of
  // the average change a bf16 master loses or adds over fp32's. Stochastic
  // rounding moves each element by whole bf16 steps at random, so the
  // element-wise difference is about as large as the updates themselves (a
  // relative L2 difference near 1, by design), but unbiased: the mean
  // update is kept. Rounding to nearest loses updates under half a step.
  // Each variant's change is counted from its own start: the bf16 master
  // starts at param0 rounded to bf16, and that rounding is not the update's.
  auto mean_update_error = [&](const at::Tensor& p, const at::Tensor& start) {
    const at::Tensor fp32_change = (ours_p - param0).to(torch::kDouble);
    const at::Tensor change = p.to(torch::kDouble) - start.to(torch::kDouble);
    return ((change - fp32_change).sum().abs() / fp32_change.abs().sum()).item<double>();
  };
  const double b16_rel = mean_update_error(b16_p, param0.to(torch::kBFloat16));
  const double q8_mean_error = mean_update_error(q8_p, param0);
  std::printf("zero bench adam: %lld fp32 parameters, %s kernel, %d threads (oneTBB; LibTorch %d); median of %lld "
              "interleaved rounds\n",
              static_cast<long long>(n), optim::cpu_adam_isa(), tbb::this_task_arena::max_concurrency(),
              at::get_num_threads(), static_cast<long long>(steps));
  std::printf("  %-40s %14s %10s %12s\n", "", "params/s", "GB/s", "zero/this");
  std::printf("  %-40s %14.3e %10.2f %12s\n", "zero CPU AdamW (fused, one pass)", n / t_ours_w, ours_bw / 1e9, "");
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "at::_fused_adamw_ (AdamW(fused=True))", n / t_fused,
              fused_bw / 1e9, t_fused / t_ours_w);
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "zero CPU AdamW, 8-bit states (16 B/el.)", n / t_q8, q8_bw / 1e9,
              t_q8 / t_ours_w);
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "zero CPU AdamW, bf16 master+states (16 B)", n / t_b16, b16_bw / 1e9,
              t_b16 / t_ours_w);
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "  the same with bf16 gradients (14 B)", n / t_b16g,
              (b16_bytes_per_param - 2) * n / t_b16g / 1e9, t_b16g / t_ours_w);
  std::printf("  %-40s\n", "the offloaded step's unscale + AdamW, fp32 master and states:");
  // A row of it: the variant's parameters/s, its bytes/s and its speed against the step before.
  auto step_row = [&](const char* label, double secs, double bytes_per_param) {
    std::printf("  %-40s %14.3e %10.2f %11.2fx\n", label, n / secs, bytes_per_param * n / secs / 1e9, t_g32 / secs);
  };
  step_row("  fp32 grads, unscaled first (36 B)", t_g32, 36.0);
  step_row("  fp32 grads, unscaled in pass (28 B)", t_g32_pass, 28.0);
  step_row("  bf16 grads, widened first (42 B)", t_g16_first, 42.0);
  step_row("  bf16 grads, widened in pass (26 B)", t_g16_pass, 26.0);
  std::printf("  %-40s %14s %10s %12s\n", "  (results: fp32 rows, bf16 rows)", "", "",
              g32_same && g16_same ? "identical" : "DIFFER");
  std::printf("  %-40s %14.3e %10s %12s\n", "zero CPU Adam, L2 decay", n / t_ours_l2, "", "");
  std::printf("  %-40s %14.3e %10s %11.2fx\n", "torch::optim::Adam, L2 decay", n / t_torch, "", t_torch / t_ours_l2);
  std::printf("  %-40s %14s %10.2f\n", "Adam's traffic, no math (28 B/element)", "", pattern_bw / 1e9);
  std::printf("  %-40s %14s %10.2f\n", "stream triad a = b + s*c (16 B/element)", "", triad_bw / 1e9);
  std::printf("  %-40s %14.3e %10.2f %12s\n", "zero gradient norm (fp64 sum of squares)", n / t_norm, 4.0 * n / t_norm / 1e9,
              "");
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "  the same over bf16 gradients", n / t_norm16,
              2.0 * n / t_norm16 / 1e9, t_norm / t_norm16);
  std::printf("  %-40s %14.3e %10.2f %11.2fx\n", "at::linalg_vector_norm (fp32)", n / t_norm_aten,
              4.0 * n / t_norm_aten / 1e9, t_norm_aten / t_norm);
  std::printf("  zero AdamW's bytes/s as a fraction of the same traffic without math: %.2f (8-bit states: %.2f); "
              "largest difference from _fused_adamw_: %.2e\n",
              ours_bw / pattern_bw, q8_bw / pattern_bw, max_diff);
  std::printf("  8-bit states: %.2fx the fp32-state kernel's parameters/s; after %lld steps their parameters' change "
              "differs from fp32 states' by %.2f%%\n",
              t_ours_w / t_q8, static_cast<long long>(steps + 1), 100 * q8_rel);
  std::printf("  one thread, in its cache (%lld elements): fp32 states %.3f ns an element, 8-bit %.3f (%.2fx the "
              "fp32 kernel's time: the arithmetic that bounds the 8-bit pass where memory does not)\n",
              static_cast<long long>(kInCache), c32_ns, c8_ns, c8_ns / c32_ns);
  std::printf("  bf16 master and states: %.2fx the fp32-state kernel's parameters/s (%.2f of the traffic roof); "
              "the mean update's error against fp32's after %lld steps: %.3f%% of the mean update (stochastic "
              "rounding: each element moves by whole bf16 steps, unbiased on average)\n",
              t_ours_w / t_b16, b16_bw / pattern_bw, static_cast<long long>(steps + 1), 100 * b16_rel);
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "adam"},
                        {"numel", n},
                        {"isa", optim::cpu_adam_isa()},
                        {"threads", tbb::this_task_arena::max_concurrency()},
                        {"torch_threads", at::get_num_threads()},
                        {"ours_params_per_s", n / t_ours_l2},
                        {"torch_params_per_s", n / t_torch},
                        {"ratio_vs_torch", t_torch / t_ours_l2},
                        {"ours_adamw_params_per_s", n / t_ours_w},
                        {"fused_adamw_params_per_s", n / t_fused},
                        {"ratio_vs_fused_adamw", t_fused / t_ours_w},
                        {"adamw_8bit_params_per_s", n / t_q8},
                        {"ratio_8bit_vs_fp32_states", t_ours_w / t_q8},
                        {"in_cache_fp32_ns_per_param", c32_ns},
                        {"in_cache_8bit_ns_per_param", c8_ns},
                        {"ratio_8bit_vs_fused_adamw", t_fused / t_q8},
                        {"adamw_8bit_bytes_per_param", q8_bytes_per_param},
                        {"adamw_8bit_bytes_per_s", q8_bw},
                        {"adamw_8bit_bandwidth_fraction", q8_bw / pattern_bw},
                        {"adamw_8bit_rel_change_vs_fp32", q8_rel},
                        {"adamw_bf16_params_per_s", n / t_b16},
                        {"adamw_bf16_grads_params_per_s", n / t_b16g},
                        {"ratio_bf16_vs_fp32_states", t_ours_w / t_b16},
                        {"adamw_bf16_bytes_per_param", b16_bytes_per_param},
                        {"adamw_bf16_bandwidth_fraction", b16_bw / pattern_bw},
                        {"adamw_bf16_mean_update_error_vs_fp32", b16_rel},
                        {"adamw_8bit_mean_update_error_vs_fp32", q8_mean_error},
                        {"max_abs_diff_vs_fused_adamw", max_diff},
                        {"ours_bytes_per_s", ours_bw},
                        {"fused_adamw_bytes_per_s", fused_bw},
                        {"adam_pattern_bytes_per_s", pattern_bw},
                        {"triad_bytes_per_s", triad_bw},
                        {"bandwidth_fraction", ours_bw / pattern_bw},
                        {"grad_norm_fp64_params_per_s", n / t_norm},
                        {"aten_norm_fp32_params_per_s", n / t_norm_aten},
                        {"ratio_grad_norm_vs_aten", t_norm_aten / t_norm},
                        {"grad_norm_vs_adamw_time", t_norm / t_ours_w},
                        {"step_fp32_grads_params_per_s", n / t_g32},
                        {"step_fp32_grads_in_pass_params_per_s", n / t_g32_pass},
                        {"ratio_fp32_grads_in_pass_vs_unscaled_first", t_g32 / t_g32_pass},
                        {"fp32_grads_in_pass_same_bits", g32_same},
                        {"step_bf16_grads_widened_first_params_per_s", n / t_g16_first},
                        {"step_bf16_grads_in_pass_params_per_s", n / t_g16_pass},
                        {"ratio_bf16_grads_in_pass_vs_fp32_grads", t_g32 / t_g16_pass},
                        {"ratio_bf16_grads_in_pass_vs_widened_first", t_g16_first / t_g16_pass},
                        {"bf16_grads_in_pass_same_bits", g16_same},
                        {"grad_norm_bf16_params_per_s", n / t_norm16}};
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
