// zero bench stage3: what prefetching stage 3's parameter gathers buys, on
// real ranks (zero launch): the same minGPT trained with stage 3 with
// prefetch off (stage3_prefetch_bucket_size 0) and on, both with
// stage3_max_reuse_distance 0 so layers are gathered again for backward (all
// but the last, whose backward follows its forward at distance 0), and with
// stage 2 (parameters whole) for reference.
#include <unistd.h>

#include <cstdint>
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
  int64_t prefetch;  // stage3_prefetch_bucket_size
};

}  // namespace

int bench_stage3(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--nproc", 2},      {"--n_layer", 6}, {"--n_embd", 256},
                                         {"--batch_size", 8}, {"--steps", 20},  {"--prefetch", 2000000}};
  std::string json_path;
  if (!parse_bench_options("zero bench stage3", args, ints, json_path)) return 2;
  const ScratchDir scratch("stage3");
  const std::string& dir = scratch.path();
  const Variant variants[] = {{"stage 2 (parameters whole)", 2, 0},
                              {"stage 3, prefetch off", 3, 0},
                              {"stage 3, prefetch on", 3, ints["--prefetch"]}};
  // A character-level text task (minGPT's --data) on generated text, for
  // sequences long enough that each layer has real work.
  const std::string text = dir + "/text.txt";
  {
    std::ofstream out(text);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < 200000; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      out << ((x % 7 == 0) ? ' ' : static_cast<char>('a' + x % 26));
    }
  }
  std::vector<nlohmann::json> results;
  int index = 0;
  for (const auto& v : variants) {
    nlohmann::json zero = {{"stage", v.stage},
                            {"overlap_comm", true},
                            {"stage3_prefetch_bucket_size", v.prefetch},
                            {"stage3_max_reuse_distance", 0},
                            {"stage3_param_persistence_threshold", 0}};
    nlohmann::json c = mingpt_bench_config(ints["--batch_size"], zero);
    const auto a = mingpt_bench_args(ints["--n_layer"], ints["--n_embd"], ints["--steps"],
                                     {"--block_size", "64", "--data", text});
    auto r = run_mingpt_ranks("zero bench stage3", dir, "variant" + std::to_string(index++), ints["--nproc"], c, a);
    if (!r) return 1;
    results.push_back(std::move(*r));
  }
  auto per_step = [](const nlohmann::json& r, double x) { return x / r["steps"].get<double>(); };
  auto step_ms = [&](const nlohmann::json& r) { return 1e3 * per_step(r, r["avg_epoch_time_s"].get<double>()); };
  auto wait_ms = [&](const nlohmann::json& r) {
    return r.contains("stage3") ? 1e3 * per_step(r, r["stage3"]["gather_wait_s"].get<double>()) : 0.0;
  };
  auto gathers = [&](const nlohmann::json& r) {
    return r.contains("stage3") ? per_step(r, r["stage3"]["gathers"].get<double>()) : 0.0;
  };
  auto prefetched = [&](const nlohmann::json& r) {
    return r.contains("stage3") ? per_step(r, r["stage3"]["prefetched_gathers"].get<double>()) : 0.0;
  };
  const nlohmann::json &s2 = results[0], &off = results[1], &on = results[2];
  std::printf("zero bench stage3: minGPT %lld parameters, %lld layers, on %lld ranks (%s), micro-batch %lld, "
              "%lld steps, prefetch bucket %lld elements\n",
              static_cast<long long>(s2["num_parameters"].get<int64_t>()), static_cast<long long>(ints["--n_layer"]),
              static_cast<long long>(ints["--nproc"]),
              s2.value("device", std::string("cpu")) == "cpu" ? "Gloo, CPU" : "NCCL, GPU",
              static_cast<long long>(ints["--batch_size"]),
              static_cast<long long>(ints["--steps"]), static_cast<long long>(ints["--prefetch"]));
  std::printf("  %-28s %10s %22s %14s %18s\n", "", "ms/step", "gather wait ms/step", "gathers/step",
              "prefetched/step");
  for (size_t i = 0; i < results.size(); ++i)
    std::printf("  %-28s %10.2f %22.2f %14.1f %18.1f\n", variants[i].label, step_ms(results[i]),
                wait_ms(results[i]), gathers(results[i]), prefetched(results[i]));
  const double wait_cut = wait_ms(off) > 0 ? 1.0 - wait_ms(on) / wait_ms(off) : 0.0;
  std::printf("  step time, prefetch on / off:       %.3f\n", step_ms(on) / step_ms(off));
  std::printf("  gather wait removed by prefetch:    %.1f%%\n", 100 * wait_cut);
  std::printf("  step time, stage 3 (prefetch) / 2:  %.3f\n", step_ms(on) / step_ms(s2));
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "stage3"},
                        {"ranks", ints["--nproc"]},
                        {"num_parameters", s2["num_parameters"]},
                        {"stage2_step_ms", step_ms(s2)},
                        {"prefetch_off_step_ms", step_ms(off)},
                        {"prefetch_on_step_ms", step_ms(on)},
                        {"prefetch_off_gather_wait_ms_per_step", wait_ms(off)},
                        {"prefetch_on_gather_wait_ms_per_step", wait_ms(on)},
                        {"prefetch_on_prefetched_gathers_per_step", prefetched(on)},
                        {"gathers_per_step", gathers(on)},
                        {"ratio_prefetch_on_vs_off_step_time", step_ms(on) / step_ms(off)},
                        {"gather_wait_removed_fraction", wait_cut},
                        {"ratio_stage3_vs_stage2_step_time", step_ms(on) / step_ms(s2)}};
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
