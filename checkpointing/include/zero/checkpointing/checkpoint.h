// Activation checkpointing (DeepSpeed's deepspeed.checkpointing), which
// LibTorch's C++ API lacks.
//
//   auto y = checkpointer.checkpoint(block, x);   // or checkpoint(fn, {x, mask})
//
// NOTE [activation checkpoint]
// A custom autograd Function. Forward runs `fn` without recording a graph and
// keeps only its inputs, plus the RNG states (CPU, and the device's when it is
// a GPU) so dropout draws the same masks again. Backward brings the inputs
// back, re-runs `fn` with grad enabled under the saved RNG states (the
// caller's RNG state is restored afterwards), and back-propagates the incoming
// gradients through the recomputed graph. Per the `activation_checkpointing`
// section, the kept inputs are:
//   partition_activations: split across the ranks of a partition group (the
//     model-parallel group, whose ranks hold the same activations); each
//     keeps 1/M and the group all-gathers them before the recompute;
//   cpu_checkpointing: copied to host memory (pinned; on a GPU on a side
//     stream, NOTE [device streams]) and copied back before the recompute,
//     once that copy has ended (the compute stream waits for it, not the host).
//     The copy out may still run when checkpoint() returns: an input written
//     in place afterwards (x += ...) could be read half-written, so write to
//     a new tensor (autograd refuses such writes to saved tensors anyway);
//   contiguous_memory_optimization: placed in one preallocated buffer with
//     number_checkpoints slots, reused every micro-step;
//   synchronize_checkpoint_boundary: the device is synchronised at each
//     checkpoint (GPU only); profile: per-checkpoint forward and recompute
//     times logged at the end of each micro-step.
// Kept inputs are counted in the memory ledger as activations, on the tier
// where they live.
//
// `fn` must be callable again in backward (it captures the module by
// reference: the module must outlive backward). Not thread-safe: one training
// thread uses a Checkpointer.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/config/config.h"
#include "zero/core/copy_mode.h"
#include "zero/core/memory_ledger.h"

namespace zero {
class Comm;  // zero/core/comm.h (internal)
}  // namespace zero

namespace zero::checkpointing {

/// A checkpointed function: the inputs in, the outputs out.
using Function = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
/// A checkpointed function of one input and one output.
using UnaryFunction = std::function<at::Tensor(const at::Tensor&)>;

/// Runs functions as activation checkpoints (NOTE [activation checkpoint])
/// per an `activation_checkpointing` config section. Each engine owns one
/// (Engine::checkpointer). Not copyable. Not thread-safe: one training
/// thread calls it, one call at a time; the recompute runs during that
/// thread's backward (possibly on an autograd thread, while it waits).
class Checkpointer {
 public:
  /// `ledger` (may be null) counts kept inputs. `partition_group` (may be
  /// null) is the group partition_activations splits across; without one,
  /// partitioning is off and this is logged once. `cpu_copy_mode`: on a
  /// machine without a GPU, CopyMode::kDeferred holds the copies to host
  /// memory back until they are waited for (tests, NOTE [device streams]).
  /// Throws zero::ConfigError for contiguous_memory_optimization without
  /// number_checkpoints.
  Checkpointer(config::ActivationCheckpointingConfig config, MemoryLedger* ledger = nullptr,
               Comm* partition_group = nullptr, CopyMode cpu_copy_mode = CopyMode::kImmediate);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Runs `fn(inputs)` as a checkpoint (NOTE [activation checkpoint]).
  /// Outputs that are not floating point are marked non-differentiable.
  /// Throws what `fn` throws; zero::ConfigError when
  /// contiguous_memory_optimization's buffer is too small for this
  /// checkpoint; zero::OutOfMemoryError past a ledger tier's limit; the
  /// recompute in backward throws zero::CommunicationError when a partitioned
  /// input cannot be gathered.
  std::vector<at::Tensor> checkpoint(const Function& fn, const std::vector<at::Tensor>& inputs);
  /// The same for one input and one output: returns fn(x). Throws as above.
  at::Tensor checkpoint(const UnaryFunction& fn, const at::Tensor& x);
  /// A module holder (TORCH_MODULE) with forward(Tensor).
  template <typename M>
  at::Tensor checkpoint(M& module, const at::Tensor& x) {
    return checkpoint(UnaryFunction([&module](const at::Tensor& t) { return module->forward(t); }), x);
  }

  /// Ends a micro-step (after its backward): frees the contiguous slots for
  /// reuse and logs the profile when enabled.
  void end_micro_step();

  /// The activation_checkpointing section it was made with.
  const config::ActivationCheckpointingConfig& config() const { return config_; }
  /// Whether inputs are really partitioned (a group of more than one rank).
  bool partitioning() const { return partition_group_ != nullptr; }

  /// The checkpointer's state: an incomplete type outside checkpoint.cpp.
  struct Impl;

 private:
  config::ActivationCheckpointingConfig config_;
  Comm* partition_group_;
  std::unique_ptr<Impl> impl_;
};

/// Checkpointing from anywhere in a model's code, as DeepSpeed's
/// deepspeed.checkpointing.checkpoint: through this thread's engine's
/// checkpointer (configured by its config's activation_checkpointing
/// section: partitioning, cpu_checkpointing, profile) while there is one,
/// else plain (inputs kept as they are, recompute in backward). A module
/// needs no pointer to its engine.
std::vector<at::Tensor> checkpoint(const Function& fn, const std::vector<at::Tensor>& inputs);
/// The same for one input and one output.
at::Tensor checkpoint(const UnaryFunction& fn, const at::Tensor& x);
/// This thread's engine's checkpointer (the last engine initialized on this
/// thread that still lives), or null.
Checkpointer* current();
/// The engine registers its checkpointer for the calling thread at initialize and
/// takes it out when it goes (from any thread): current() on that thread is
/// then the newest of those still registered. Not owned. Thread-safe.
void register_current(Checkpointer* checkpointer);
/// Takes `checkpointer` out of what register_current registered, on
/// whichever thread it was registered for. Call it from any thread.
void unregister_current(Checkpointer* checkpointer);

/// Runs `fn` when the backward pass in progress on this thread ends: the
/// outermost one, also when called from inside a checkpoint's recompute
/// (whose nested backward is a pass of its own). Call it from a backward.
void queue_when_backward_ends(std::function<void()> fn);

}  // namespace zero::checkpointing
