// Helpers the engine and zero::Init share.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <string>

#include <torch/cuda.h>
#include <torch/types.h>

#include "zero/config/config.h"
#include "zero/offload/aio.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

inline torch::Device default_device() {
  if (torch::cuda::is_available()) {
    int local_rank = 0;
    if (const char* v = std::getenv("LOCAL_RANK")) local_rank = std::atoi(v);
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  return torch::Device(torch::kCPU);
}

// Pinned memory is bounded by default to half of physical memory, so pinning
// never starves the host.
inline int64_t default_pinned_limit() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 2 : 0;
}

/// The config's aio section as the engine's options.
inline offload::AioOptions aio_options(const config::AioConfig& a) {
  offload::AioOptions o;
  o.block_size = a.block_size;
  o.queue_depth = a.queue_depth;
  o.threads = a.intra_op_parallelism;
  o.single_submit = a.single_submit;
  o.overlap_events = a.overlap_events;
  return o;
}

/// Loads `config` (a path, or JSON text starting with '{') for the job in `options.dist`.
inline config::Config load_config(const std::string& config, const InitOptions& options) {
  config::LoadOptions lo;
  lo.world_size = options.dist->world_size;
  lo.auto_values = options.auto_values;
  const auto first = config.find_first_not_of(" \t\r\n");
  const bool is_json = first != std::string::npos && config[first] == '{';
  return is_json ? config::load_string(config, lo) : config::load_file(config, lo);
}

}  // namespace zero::detail
