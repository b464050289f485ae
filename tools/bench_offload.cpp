// zero bench offload: the optimizer states in host memory (offload_optimizer
// cpu) against NVMe swap files under --path (NOTE [optimizer swapping]), the
// swap with its pipeline off (read, step, write one after another) and on
// (read ahead, write behind), on real ranks with the same minGPT and data.
// With --stage 3 the layer shards follow them (offload_param cpu / nvme with
// max_in_cpu 0; NOTE [parameter swapping]), read ahead by the gathers'
// prefetch with the pipeline and on demand without it.
// The share of the disk time the pipeline hides is 1 - (the optimizer's wait
// for reads and writes with the pipeline) / (the same without it), where
// without it every transfer is waited for.
#include <sys/stat.h>
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
  const char* name;
  const char* label;
  bool nvme;
  bool pipeline;
};

}  // namespace

int bench_offload(const std::vector<std::string>& args) {
  std::map<std::string, int64_t> ints = {{"--nproc", 2},      {"--n_layer", 4}, {"--n_embd", 384},
                                         {"--batch_size", 8}, {"--steps", 10},  {"--sub_group", 500000},
                                         {"--buffers", 4},    {"--stage", 2}};
  std::string json_path, path;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--path" && i + 1 < args.size()) path = args[++i];
    else rest.push_back(args[i]);
  }
  if (!parse_bench_options("zero bench offload", rest, ints, json_path)) return 2;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::cerr << "zero bench offload: --path " << path << ": expected an existing folder for the swap files\n";
    return 2;
  }
  const int64_t stage = ints["--stage"];
  if (stage < 1 || stage > 3) {
    std::cerr << "zero bench offload: --stage: expected 1, 2 or 3; got " << stage << "\n";
    return 2;
  }
  if (path.empty()) {
    std::cerr << "zero bench offload: --path DIR is required (a folder on the disk for the swap files)\n";
    return 2;
  }
  const ScratchDir scratch("offload");
  const std::string& dir = scratch.path();
  const Variant variants[] = {{"cpu", "offload to CPU memory", false, false},
                              {"nvme_serial", "NVMe, pipeline off", true, false},
                              {"nvme_pipelined", "NVMe, pipeline on", true, true}};
  std::vector<nlohmann::json> results;
  for (const auto& v : variants) {
    nlohmann::json offload = {{"device", "cpu"}, {"pin_memory", true}};
    if (v.nvme) {
      offload = {{"device", "nvme"},
                 {"nvme_path", path},
                 {"buffer_count", ints["--buffers"]},
                 {"pipeline_read", v.pipeline},
                 {"pipeline_write", v.pipeline}};
    }
    nlohmann::json zero = {{"stage", stage},
                            {"overlap_comm", true},
                            {"sub_group_size", ints["--sub_group"]},
                            {"offload_optimizer", offload}};
    nlohmann::json c = mingpt_bench_config(ints["--batch_size"], zero);
    if (stage == 3) {
      // The layer shards follow the optimizer states: host memory, or disk
      // with every shard swapped (max_in_cpu 0), read by the gathers'
      // prefetch (on with the pipeline, off without it).
      auto& z = c["zero_optimization"];
      z["stage3_param_persistence_threshold"] = 0;
      z["stage3_prefetch_bucket_size"] = v.pipeline || !v.nvme ? 2000000 : 0;
      z["offload_param"] = {{"device", "cpu"}};
      if (v.nvme) {
        z["offload_param"] = {{"device", "nvme"},
                              {"nvme_path", path},
                              {"buffer_count", ints["--buffers"]},
                              {"buffer_size", 100000000},
                              {"max_in_cpu", 0}};
      }
    }
    const auto a = mingpt_bench_args(ints["--n_layer"], ints["--n_embd"], ints["--steps"]);
    auto r = run_mingpt_ranks("zero bench offload", dir, v.name, ints["--nproc"], c, a);
    if (!r) return 1;
    results.push_back(std::move(*r));
  }
  auto per_step_ms = [](const nlohmann::json& r, double x) { return 1e3 * x / r["steps"].get<double>(); };
  auto step_ms = [&](const nlohmann::json& r) { return per_step_ms(r, r["avg_epoch_time_s"].get<double>()); };
  auto nv = [&](const nlohmann::json& r, const char* key) {
    return r.contains("nvme") ? per_step_ms(r, r["nvme"][key].get<double>()) : 0.0;
  };
  // The optimizer's waits for its states and, at stage 3, the gathers' waits
  // for shards read from disk.
  auto wait_ms = [&](const nlohmann::json& r) {
    return nv(r, "read_wait_s") + nv(r, "write_wait_s") + nv(r, "param_read_wait_s");
  };
  const nlohmann::json &cpu = results[0], &serial = results[1], &piped = results[2];
  const double hidden = wait_ms(serial) > 0 ? std::max(0.0, 1.0 - wait_ms(piped) / wait_ms(serial)) : 0.0;
  // Read and written each step; stage 3's shards are read for forward and
  // backward and written once.
  const double gb_per_step = (piped["nvme"]["file_bytes"].get<double>() * 2 +
                              piped["nvme"]["param_bytes_read"].get<double>() / piped["steps"].get<double>() +
                              piped["nvme"]["param_file_bytes"].get<double>()) /
                             1e9;
  std::printf("zero bench offload: minGPT %lld parameters on %lld ranks, stage %lld, micro-batch %lld, %lld steps, "
              "sub_group_size %lld, buffer_count %lld, swap files under %s (%.3f GB moved per rank per step)\n",
              static_cast<long long>(cpu["num_parameters"].get<int64_t>()), static_cast<long long>(ints["--nproc"]),
              static_cast<long long>(stage), static_cast<long long>(ints["--batch_size"]), static_cast<long long>(ints["--steps"]),
              static_cast<long long>(ints["--sub_group"]), static_cast<long long>(ints["--buffers"]), path.c_str(),
              gb_per_step);
  std::printf("  %-24s %10s %20s %20s %20s\n", "", "ms/step", "optimizer step ms", "states wait ms",
              "shard read wait ms");
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    if (r.contains("nvme"))
      std::printf("  %-24s %10.2f %20.2f %20.2f %20.2f\n", variants[i].label, step_ms(r), nv(r, "optimizer_step_s"),
                  nv(r, "read_wait_s") + nv(r, "write_wait_s"), nv(r, "param_read_wait_s"));
    else
      std::printf("  %-24s %10.2f %20s %20s %20s\n", variants[i].label, step_ms(r), "-", "-", "-");
  }
  // Stage 3: the share of shard reads that found the shard still in a swap
  // buffer (NOTE [parameter swapping]) instead of going to the disk.
  auto from_buffers = [](const nlohmann::json& r) {
    if (!r.contains("nvme")) return 0.0;
    const double read = r["nvme"]["param_bytes_read"].get<double>(), cached = r["nvme"]["param_bytes_cached"].get<double>();
    return read + cached > 0 ? cached / (read + cached) : 0.0;
  };
  if (stage == 3)
    std::printf("  shard reads served from swap buffers:       %.1f%% (pipeline off), %.1f%% (on)\n",
                100 * from_buffers(serial), 100 * from_buffers(piped));
  std::printf("  step time, NVMe (pipelined) / CPU offload:  %.3f\n", step_ms(piped) / step_ms(cpu));
  std::printf("  step time, NVMe pipeline on / off:          %.3f\n", step_ms(piped) / step_ms(serial));
  std::printf("  disk wait hidden by the pipeline:            %.1f%%\n", 100 * hidden);
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "offload"},
                        {"ranks", ints["--nproc"]},
                        {"stage", stage},
                        {"num_parameters", cpu["num_parameters"]},
                        {"cpu_offload_step_ms", step_ms(cpu)},
                        {"nvme_serial_step_ms", step_ms(serial)},
                        {"nvme_pipelined_step_ms", step_ms(piped)},
                        {"nvme_serial_disk_wait_ms_per_step", wait_ms(serial)},
                        {"nvme_pipelined_disk_wait_ms_per_step", wait_ms(piped)},
                        {"nvme_serial_shard_read_wait_ms_per_step", nv(serial, "param_read_wait_s")},
                        {"nvme_pipelined_shard_read_wait_ms_per_step", nv(piped, "param_read_wait_s")},
                        {"nvme_swap_gb_per_rank_per_step", gb_per_step},
                        {"ratio_nvme_vs_cpu_step_time", step_ms(piped) / step_ms(cpu)},
                        {"ratio_pipeline_on_vs_off_step_time", step_ms(piped) / step_ms(serial)},
                        {"hidden_disk_wait_fraction", hidden},
                        {"nvme_serial_shard_reads_from_buffers_fraction", from_buffers(serial)},
                        {"nvme_pipelined_shard_reads_from_buffers_fraction", from_buffers(piped)}};
    write_json_output(json_path, j);
  }
  return 0;
}

}  // namespace zero::tools
