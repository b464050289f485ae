// Model-state memory per rank, estimated from a config and the parameters'
// sizes, as the engine lays the states out (NOTE [memory estimate] in
// runtime/src/estimate.cpp): which tier holds the 16- or 32-bit parameters,
// the gradients and the optimizer states at each ZeRO stage and offload
// setting, with the flat layout's padding, stage 3's persistent parameters
// and always-gathered group, the NVMe swap files and their host buffers.
// `zero estimate` prints it; tests/tools/estimate_test.cpp holds it to the
// memory ledger's figures.
//
// Not included (yet): activations, communication buckets and prefetch
// buffers, which depend on the model's code and the batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zero/config/config.h"

namespace zero {

/// One trainable parameter: its name, element count and the stage-3 layer it
/// belongs to (-1: outside every layer, always gathered at stage 3).
struct ParameterShape {
  std::string name;
  int64_t numel = 0;
  int layer = -1;
};

/// minGPT's parameters (benchmarks/mingpt) in the model's order: tok_emb,
/// pos_emb (outside every layer), n_layer blocks, ln_f, head. Its stage-3
/// layers: tok_emb, each block, ln_f, head.
std::vector<ParameterShape> mingpt_parameters(int64_t n_layer, int64_t n_embd, int64_t vocab_size, int64_t block_size,
                                              bool tie_weights = false);

/// A model known only by its size: one parameter in one layer.
std::vector<ParameterShape> parameters_of_size(int64_t num_parameters);

struct StateBytes {
  int64_t parameters = 0, gradients = 0, optimizer_states = 0;
  int64_t total() const { return parameters + gradients + optimizer_states; }
};

/// Per rank. `host` is pinned and pageable host memory together.
struct MemoryEstimate {
  int64_t num_parameters = 0;
  StateBytes device, host, nvme;
};

/// The model states of one rank for `config` (its stage, precision, offload
/// settings, thresholds and swap settings; config.world_size ranks).
MemoryEstimate estimate_model_states(const config::Config& config, const std::vector<ParameterShape>& params);

}  // namespace zero
