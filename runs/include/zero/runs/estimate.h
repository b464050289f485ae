// Model-state memory per rank, estimated from a config and the parameters'
// sizes, as the engine lays the states out (NOTE [memory estimate] in
// runs/src/estimate.cpp): which tier holds the 16- or 32-bit parameters,
// the gradients and the optimizer states at each ZeRO stage and offload
// setting, with the flat layout's padding, stage 3's persistent parameters
// and always-gathered group, the NVMe swap files and their host buffers.
// `zero estimate` prints it; tests/tools/estimate_test.cpp holds it to the
// memory ledger's figures.
//
// estimate_peak adds, for minGPT, the activations and the engine's buffers
// of a training step (NOTE [peak estimate]).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zero/config/config.h"

namespace zero {

/// One trainable parameter: its name, element count and the stage-3 layer it
/// belongs to (-1: outside every layer, always gathered at stage 3).
struct ParameterShape {
  std::string name;  ///< The parameter's name in the model ("blocks.0.fc.weight").
  int64_t numel = 0;  ///< Its element count.
  int layer = -1;  ///< Its stage-3 layer, 0-based; -1: outside every layer.
  /// Frozen (requires_grad false): no gradient, master or optimizer state;
  /// partitioned at stage 3 in its layer's frozen group (NOTE [frozen groups]).
  bool frozen = false;
};

/// minGPT's parameters (benchmarks/mingpt) in the model's order: pos_emb
/// (outside every layer), tok_emb, n_layer blocks, ln_f, head (none with
/// `tie_weights`). Its stage-3 layers: tok_emb, each block, ln_f, head.
std::vector<ParameterShape> mingpt_parameters(int64_t n_layer, int64_t n_embd, int64_t vocab_size, int64_t block_size,
                                              bool tie_weights = false);

/// A model known only by its size: one parameter in one layer.
std::vector<ParameterShape> parameters_of_size(int64_t num_parameters);

/// One tier's model-state bytes for one rank.
struct StateBytes {
  /// @var parameters
  /// Trainable parameters, bytes (with offload_param nvme, the host's also
  /// holds the swap buffers).
  /// @var gradients
  /// Gradients, bytes.
  /// @var optimizer_states
  /// Optimizer states and the master copy of the parameters (none where the
  /// fp32 parameters are the master), bytes (with offload_optimizer nvme,
  /// the host's also holds the swap buffers).
  int64_t parameters = 0, gradients = 0, optimizer_states = 0;
  /// Frozen parameters: not model states, but held (NOTE [frozen groups]).
  int64_t frozen_parameters = 0;
  /// The sum of the four, bytes.
  int64_t total() const { return parameters + gradients + optimizer_states + frozen_parameters; }
};

/// Per rank. `host` is pinned and pageable host memory together.
struct MemoryEstimate {
  int64_t num_parameters = 0;  ///< Elements of every parameter given, frozen ones included.
  /// @var device
  /// The model states on the device.
  /// @var host
  /// The model states in host memory, pinned and pageable.
  /// @var nvme
  /// The model states in NVMe swap files.
  StateBytes device, host, nvme;
};

/// The model states of one rank for `config` (its stage, precision, offload
/// settings, thresholds and swap settings; config.world_size ranks).
MemoryEstimate estimate_model_states(const config::Config& config, const std::vector<ParameterShape>& params);

/// One micro-batch of minGPT (benchmarks/mingpt) on each rank.
struct MinGPTWorkload {
  /// @var n_layer
  /// Transformer blocks.
  /// @var n_embd
  /// Embedding width, elements.
  /// @var n_head
  /// Attention heads.
  /// @var vocab_size
  /// Vocabulary size, tokens.
  /// @var block_size
  /// Sequence length, tokens.
  int64_t n_layer = 1, n_embd = 64, n_head = 1, vocab_size = 0, block_size = 0;
  bool tie_weights = false;  ///< The head shares tok_emb's weight (no head.weight).
  int64_t micro_batch = 1;  ///< Sequences in a micro-batch on each rank.
  /// Checkpoints every block (`mingpt --checkpoint`), as the config's
  /// activation_checkpointing says.
  bool checkpointing = false;
};

/// A training step's peak per rank: the model states and what exists only
/// while a step runs (NOTE [peak estimate] in runs/src/estimate.cpp).
struct PeakEstimate {
  MemoryEstimate states;  ///< The model states (estimate_model_states).
  int64_t activations = 0;       ///< on the device, bytes
  int64_t host_activations = 0;  ///< cpu_checkpointing's block inputs, bytes
  int64_t device_buffers = 0;    ///< gradient buckets, gathered layers, a gradient before its hook, bytes
  int64_t host_buffers = 0;      ///< pinned staging of offloaded gradients and new values, bytes
  /// The device's peak, bytes: its model states, activations and buffers.
  int64_t device() const { return states.device.total() + activations + device_buffers; }
  /// Host memory's peak, bytes: its model states, activations and buffers.
  int64_t host() const { return states.host.total() + host_activations + host_buffers; }
  /// The NVMe swap files' bytes.
  int64_t nvme() const { return states.nvme.total(); }
};

/// `nccl`: the collectives run on NCCL (a reduce-scatter writes a separate
/// chunk; Gloo's is an in-place all-reduce of the bucket).
PeakEstimate estimate_peak(const config::Config& config, const MinGPTWorkload& workload, bool nccl = false);

/// A step's activations at their peak, per rank: on the device, and in host
/// memory (cpu_checkpointing's block inputs).
struct Activations {
  /// @var device
  /// Activations on the device, bytes.
  /// @var host
  /// Activations in host memory, bytes.
  int64_t device = 0, host = 0;
};

/// Any model, known by its parameters (a run report's, zero::estimate's):
/// its model states and the engine's buffers as for minGPT, with the
/// activations the caller knows (measured, or 0 for a lower bound).
PeakEstimate estimate_peak(const config::Config& config, const std::vector<ParameterShape>& params,
                           const Activations& activations, bool nccl = false);

}  // namespace zero
