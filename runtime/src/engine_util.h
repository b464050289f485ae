// Helpers the engine and zero::Init share.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include "zero/config/config.h"
#include "zero/offload/aio.h"
#include "zero/core/error.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

/// The device to train on: `asked` (InitOptions::device; "cuda" without an
/// index is cuda:LOCAL_RANK), else cuda:LOCAL_RANK when CUDA is available,
/// else the CPU. A CUDA device becomes the process's current device, as
/// DeepSpeed sets it. Throws zero::ConfigError for a GPU this machine lacks.
inline torch::Device resolve_device(const std::optional<torch::Device>& asked, const DistEnv& dist) {
  if (asked && !asked->is_cuda()) return *asked;
  if (!asked && !torch::cuda::is_available()) return torch::Device(torch::kCPU);
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = asked && asked->has_index() ? asked->index() : dist.local_rank;
  if (index >= count) {
    throw ConfigError({"device cuda:" + std::to_string(index) + (asked && asked->has_index() ? " (InitOptions::device)" : " (from LOCAL_RANK " + std::to_string(dist.local_rank) + ")") +
                       ": this machine has " + std::to_string(count) +
                       " CUDA device(s); give each rank one of them (InitOptions::device, mingpt --device), or let "
                       "ranks share one through Gloo (ZERO_DIST_BACKEND=gloo)"});
  }
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(device.index());
  return device;
}

// Pinned memory is bounded by default to half of physical memory, shared by
// the ranks of the node (LOCAL_WORLD_SIZE), so pinning never starves the host
// however many ranks run there.
inline int64_t default_pinned_limit(int64_t local_world_size) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 2 / std::max<int64_t>(1, local_world_size) : 0;
}

/// Loads `config` (a path, or JSON text starting with '{') for the job in `options.dist`.
inline config::Config load_config(const std::string& config, const InitOptions& options) {
  config::LoadOptions lo;
  lo.world_size = options.dist->world_size;
  lo.auto_values = options.auto_values;
  lo.for_training = true;
  const auto first = config.find_first_not_of(" \t\r\n");
  const bool is_json = first != std::string::npos && config[first] == '{';
  return is_json ? config::load_string(config, lo) : config::load_file(config, lo);
}

// NOTE [config warnings]
// What the config loader found that has no effect, is deprecated or is
// unknown (Config::warnings, each naming the file and key) is said by rank 0,
// each line once a process, at whichever entry reads the config first:
// zero::Init (a stage-3 program built partitioned) or initialize; `zero
// config check` prints the same list (tests/runtime/config_warnings_test.cpp
// holds the three to it). A program's flag that would fill an "auto" which
// the config gives itself (InitOptions::auto_value_flags) is said unused.
/// NOTE [outputs and inputs]: the files the environment names (ZERO_TRACE,
/// ZERO_RUN_REPORT) against what the program declared it reads and writes
/// (CommandFiles::declare: its data, weights, resumed checkpoint, its own
/// outputs), the config at `config_source`, and each other, before the run
/// starts. A library user's program declares nothing: the config is still
/// compared. Throws UsageError naming the clash.
void check_environment_outputs(const std::string& config_source, const DistEnv& dist);

/// The config's warnings (NOTE [config warnings]).
/// Also, for each of `flags` (InitOptions::auto_value_flags) whose key the
/// config gives itself, that the flag is unused.
void print_config_warnings(const config::Config& config, const DistEnv& dist,
                           const std::map<std::string, std::string>& flags = {});

/// NOTE [client optimizer]: the program's torch::optim optimizer
/// (options.optimizer, then cleared) as the config's optimizer section and
/// options' parameter groups; a config with its own section keeps it, with
/// a warning. Throws UsageError naming what zero cannot take.
void apply_client_optimizer(config::Config& config, InitOptions& options, const torch::nn::Module& model);

}  // namespace zero::detail
