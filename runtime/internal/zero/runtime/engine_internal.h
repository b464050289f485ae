// What zero's own programs (mingpt, the tests' workers) reach inside an
// Engine and users do not: internal, never installed.
#pragma once

#include <functional>
#include <string>

#include "zero/core/comm.h"
#include "zero/runtime/engine.h"

namespace zero::detail {

/// The data-parallel group's collectives (null with one process), for a
/// program that gathers its own figures across ranks. Owned by the engine.
Comm* comm_of(Engine& engine);

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

}  // namespace zero::detail
