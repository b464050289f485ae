// What zero's own programs (mingpt, the tests' workers) reach inside an
// Engine and users do not: internal, never installed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "zero/core/comm.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

/// The data-parallel group's collectives (null with one process), for a
/// program that gathers its own figures across ranks. Owned by the engine.
Comm* comm_of(Engine& engine);

/// What this rank's collectives sent since initialize, within its node and
/// across nodes (NOTE [bytes across nodes] in core/src/comm.cpp), over the
/// optimizer steps taken since then; zeros with one process.
struct CollectiveTraffic {
  CommBytes bytes;
  int64_t steps = 0;
  int node = 0;
};
CollectiveTraffic collective_traffic_of(const Engine& engine);

/// This rank's master and optimizer states, sub-group by sub-group (the
/// master, then each state), copied: a test compares runs bit for bit.
std::vector<torch::Tensor> optimizer_states_of(Engine& engine);

/// What offload_optimizer.super_offload's speculation did (NOTE
/// [speculative step]), since initialize.
struct SpeculationCounts {
  int64_t planned = 0;    // boundary backwards that stepped ahead
  int64_t validated = 0;  // steps the speculation was right for
  int64_t redone = 0;     // undone and stepped again (clipped, or not as planned)
  int64_t undone = 0;     // undone, the step skipped or abandoned (overflow, a failed backward, zero_grad)
  int64_t sub_groups = 0; // sub-group steps taken ahead; may be read during backward (a hook)
};
SpeculationCounts speculation_counts(const Engine& engine);

/// Test seams of engine checkpoints (save_checkpoint).
struct CheckpointHooks {
  /// Free bytes on the filesystem of a folder; default: statvfs.
  std::function<int64_t(const std::string& folder)> free_bytes;
  /// Called at named points of a save: "rank_files" (this rank's files are
  /// written, nothing is committed), "meta" (rank 0: meta.json written, the
  /// tag not yet in place). A test kills the process there.
  std::function<void(const std::string& point)> at;
};
void set_checkpoint_hooks(Engine& engine, CheckpointHooks hooks);
/// Whether a stop signal is held by a save in progress (NOTE [checkpoint
/// commit]): a test hook that stands still inside a save waits for it.
bool save_stop_requested();

/// mingpt's and llama's --optimizer (adamw, adam or adagrad): the
/// torch::optim optimizer a program passes as InitOptions::optimizer (NOTE
/// [client optimizer]) over `groups`, each with its own weight decay and
/// the given lr. Throws UsageError naming `flag` and the names it takes.
std::unique_ptr<torch::optim::Optimizer> program_optimizer(const std::string& flag, const std::string& name,
                                                           const std::vector<std::pair<std::vector<torch::Tensor>, double>>& groups,
                                                           double lr);

/// LoadOptions::auto_hint for mingpt and llama (`program` names it): the flag
/// that fills an AutoValues member ("--lr"), or a word that the program
/// fills none and a value must be written in the config.
std::function<std::string(const std::string&)> program_auto_hint(const std::string& program);

}  // namespace zero::detail
