// What zero::Init and the Engine both start from.
//
// NOTE [run context]
// The resolved config, the options, where this process sits in the job, the
// device (made the current CUDA device when it is one), the compute and
// gradient-accumulation dtypes, and the memory ledger with its pinned limit:
// made once by make_context(). zero::Init makes it first, and the engine that
// adopts the Init goes on with the same context (its ledger counts the shards
// built under Init), so the two cannot disagree.
#pragma once

#include <array>
#include <string>

#include <memory>

#include <torch/types.h>

#include "zero/config/config.h"
#include "zero/core/dist_env.h"
#include "zero/core/memory_ledger.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

struct RunContext {
  config::Config config;
  InitOptions options;
  DistEnv dist;
  torch::Device device{torch::kCPU};
  torch::ScalarType dtype = torch::kFloat;             // compute
  torch::ScalarType grad_accum_dtype = torch::kFloat;  // data_types.grad_accum_dtype or the default
  std::shared_ptr<MemoryLedger> ledger = std::make_shared<MemoryLedger>();
};

/// Resolves the context of `config` and `options`: the job (options.dist, else
/// the environment; it must have the world size the config was resolved
/// for), the device (resolve_device), the dtypes, the ledger's pinned limit,
/// and on the CPU the process-wide counting allocator. Throws ConfigError.
RunContext make_context(config::Config config, InitOptions options);

/// The config keys that would make a run fit when `tier` is full ("would
/// help: ..."), for out-of-memory messages.
std::string memory_help(const config::Config& cfg, Tier tier);

/// Applies InitOptions' device, host and NVMe budgets (NOTE [emulated device
/// memory] for the device on the CPU); `names` say where each came from, for
/// out-of-memory messages.
void apply_memory_budgets(const config::Config& cfg, const InitOptions& options, const torch::Device& device,
                          MemoryLedger& ledger, const std::array<std::string, 3>& names);

}  // namespace zero::detail
