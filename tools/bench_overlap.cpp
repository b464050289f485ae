// zero bench overlap: how much gradient communication stage 2 hides behind
// backward, and its step time against stage 0, on real ranks.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "bench.h"

namespace zero::tools {
namespace {

struct Variant {
  const char* label;
  int stage;
  bool overlap;
};

}  // namespace

int bench_overlap(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--nproc", 2}, {"--n_layer", 4}, {"--n_embd", 256},
                                         {"--batch_size", 16}, {"--steps", 20}, {"--bucket", 2000000}};
  std::string json_path;
  if (!parse_bench_options("zero bench overlap", args, ints, json_path)) return 2;
  const ScratchDir scratch("overlap");
  const std::string& dir = scratch.path();
  const Variant variants[] = {{"stage 0 (all-reduce)", 0, true},
                              {"stage 2, overlap_comm true", 2, true},
                              {"stage 2, overlap_comm false", 2, false}};
  std::vector<nlohmann::json> results;
  for (const auto& v : variants) {
    nlohmann::json zero = {{"stage", v.stage}, {"overlap_comm", v.overlap}, {"reduce_bucket_size", ints["--bucket"]},
                            {"allgather_bucket_size", ints["--bucket"]}};
    nlohmann::json c = mingpt_bench_config(ints["--batch_size"], zero);
    const auto a = mingpt_bench_args(ints["--n_layer"], ints["--n_embd"], ints["--steps"]);
    auto r = run_mingpt_ranks("zero bench overlap", dir,
                              "stage" + std::to_string(v.stage) + (v.overlap ? "_overlap" : ""), ints["--nproc"], c, a);
    if (!r) return 1;
    results.push_back(std::move(*r));
  }
  auto step_ms = [&](const nlohmann::json& r) {
    return 1e3 * r["avg_epoch_time_s"].get<double>() / r["steps"].get<double>();
  };
  auto wait_ms = [&](const nlohmann::json& r) { return 1e3 * r["grad_comm_wait_s"].get<double>() / r["steps"].get<double>(); };
  const double s0 = step_ms(results[0]), s2 = step_ms(results[1]), s2_off = step_ms(results[2]);
  const double exposed = wait_ms(results[1]), total = wait_ms(results[2]);
  const double hidden = total > 0 ? std::max(0.0, 1.0 - exposed / total) : 0.0;
  std::printf("zero bench overlap: minGPT %lld parameters on %lld ranks (Gloo, CPU), micro-batch %lld, %lld steps, bucket %lld elements\n",
              static_cast<long long>(results[0]["num_parameters"].get<int64_t>()),
              static_cast<long long>(ints["--nproc"]), static_cast<long long>(ints["--batch_size"]),
              static_cast<long long>(ints["--steps"]), static_cast<long long>(ints["--bucket"]));
  std::printf("  %-30s %12s %30s\n", "", "ms/step", "gradient comm wait ms/step");
  for (size_t i = 0; i < results.size(); ++i)
    std::printf("  %-30s %12.2f %30.2f\n", variants[i].label, step_ms(results[i]), wait_ms(results[i]));
  std::printf("  stage 2 step time / stage 0:            %.3f\n", s2 / s0);
  std::printf("  gradient communication hidden (stage 2): %.1f%%  (1 - wait for reductions with overlap_comm / without, where each bucket is waited for as it is reduced)\n",
              100 * hidden);
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "overlap"},
                        {"ranks", ints["--nproc"]},
                        {"num_parameters", results[0]["num_parameters"]},
                        {"stage0_step_ms", s0},
                        {"stage2_step_ms", s2},
                        {"stage2_no_overlap_step_ms", s2_off},
                        {"stage2_comm_wait_ms_per_step", exposed},
                        {"stage2_no_overlap_comm_wait_ms_per_step", total},
                        {"ratio_stage2_vs_stage0_step_time", s2 / s0},
                        {"hidden_comm_fraction", hidden}};
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
