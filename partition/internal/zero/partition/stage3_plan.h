// Planning stage 3: which modules are layers, which parameters stay whole,
// how each layer's parameters form a group, and which shards stay in host
// memory.
//
// NOTE [stage-3 plan]
// Decided once, here, by the same rules for a model built whole and one built
// under zero::Init:
//   - layers (NOTE [stage-3 layers]): the children of the outermost
//     ModuleList and Sequential containers, the modules listed in
//     InitOptions::layers and InitOptions::leaf_modules or marked by
//     zero::set_leaf (NOTE [leaf modules]), and those zero::Init
//     partitioned, in the model's order, none inside another;
//   - frozen parameters (NOTE [frozen groups]): each layer's in a group of
//     their own, after every trainable group; outside every layer, or
//     persistent, they stay whole;
//   - persistence (PersistenceRule): a parameter under
//     stage3_param_persistence_threshold stays whole while the sum of such
//     parameters stays under stage3_model_persistence_threshold; whole
//     parameters, and those outside every layer, form group 0, always gathered;
//   - groups: one per layer, its parameters in the layer's order, a tied
//     parameter in the first layer that has it (a layer using it too then
//     needs that group as well);
//   - host memory (InCpuBudget, offload_param nvme): in group order, a shard
//     stays in host memory while the shards kept sum to at most max_in_cpu;
//     the others go to the parameter swap file.
// zero::Init applies the same two rules (its own PersistenceRule and
// InCpuBudget) as each layer is built, and hands its decisions over
// (Prebuilt): the plan follows them for the layers Init built and goes on
// with Init's rule objects for the rest; the parameter swapper takes the
// plan's per-group decision (ParamSwapOptions::in_memory).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "zero/config/config.h"
#include "zero/offload/aio.h"
#include "zero/partition/stage3_rules.h"
#include "zero/partition/zero_optimizer.h"

namespace zero::partition {

/// One group of a layer zero::Init partitioned: its trainable parameters,
/// or its frozen ones (NOTE [frozen groups]).
struct PrebuiltGroup {
  std::vector<at::Tensor> params;  // partitioned, in the layer's named_parameters order
  std::vector<std::vector<int64_t>> shapes;
  at::Tensor chunk;          // this rank's chunk (compute dtype); undefined when on disk
  int64_t disk_offset = -1;  // where the chunk is in `Prebuilt::swap_file`
  bool empty() const { return params.empty(); }
};

/// A layer zero::Init partitioned as it was built.
struct PrebuiltLayer {
  // Layers are known by address: holding the module keeps a later one from
  // reusing it (a temporary passed to partition(), say).
  std::shared_ptr<torch::nn::Module> module;
  PrebuiltGroup trainable, frozen;
};

/// What zero::Init decided and made, for the plan to take over.
struct Prebuilt {
  std::unordered_map<const void*, PrebuiltLayer> layers;  // by module
  std::unordered_set<const void*> partitioned;            // parameter TensorImpls Init partitioned
  std::unordered_set<const void*> kept_whole;             // ... and those it kept whole (persistent)
  PersistenceRule persistence;
  InCpuBudget in_cpu;
  // offload_param nvme: the file the shards beyond max_in_cpu went to.
  std::shared_ptr<offload::AioFile> swap_file;
  int64_t swap_bytes = 0;
  /// Waits for the last shard's write (throws IoError if it failed).
  std::function<void()> finish_writes;
};

struct Stage3Plan {
  Stage3Layout layout;
  int64_t layer_params = 0;   // in layer groups
  int64_t always_params = 0;  // in group 0
  int64_t frozen_layer_params = 0;  // in frozen groups (NOTE [frozen groups])
  int64_t frozen_whole_params = 0;  // frozen, kept whole (outside every layer, or persistent)
};

/// Plans stage 3 for `model` (NOTE [stage-3 plan]) from the config's
/// zero_optimization and aio sections, and routes each entry of a Sequential
/// through its layer (the model changes: the entry becomes a wrapper whose
/// forward gathers the layer). `init` (may be null): what zero::Init built.
/// `swap_tag` names this rank's swap folder. Throws ConfigError (an
/// `extra_layers` entry outside the model), UsageError (a layer of another
/// live engine; a module Init partitioned that is not a layer; a parameter
/// frozen or unfrozen after Init partitioned it).
/// `leaf_modules` (InitOptions::leaf_modules) and modules zero::set_leaf
/// marked are layers whose insides are not (NOTE [leaf modules]).
Stage3Plan plan_stage3(const std::shared_ptr<torch::nn::Module>& model, const config::Config& config,
                       const std::vector<std::shared_ptr<torch::nn::Module>>& extra_layers, Prebuilt* init,
                       const std::string& swap_tag,
                       const std::vector<std::shared_ptr<torch::nn::Module>>& leaf_modules = {});

/// The config's aio section as the AIO engine's options.
offload::AioOptions aio_options(const config::AioConfig& aio);

}  // namespace zero::partition
