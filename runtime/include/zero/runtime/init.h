// Partitioned construction for ZeRO stage 3 (DeepSpeed's zero.Init): each
// layer is partitioned as soon as it is built, so no rank ever holds the
// whole model, only its shards and one layer being built.
//
//   zero::Init init("ds_config.json");        // stage 3
//   torch::manual_seed(0);                    // the same seed on every rank
//   auto net = torch::nn::Sequential();
//   for (int i = 0; i < n; ++i) net->push_back(init.partition(torch::nn::Linear(d, d)));
//   auto engine = zero::initialize(net.ptr(), init);
//
// partition() keeps this rank's chunk of the layer's parameters (laid out as
// the engine lays out a stage-3 layer: frozen parameters in a shard of their
// own, NOTE [frozen groups]) and empties the parameters. Which parameters
// train is decided then: by their requires_grad, or by InitOptions::trainable
// (zero::trainable_matching), so a LoRA model built under Init is frozen as
// it is partitioned; freezing a partitioned parameter later is refused at
// initialize. Every rank
// builds each layer whole from the same random stream, so the values are the
// ones the unpartitioned model would have with the same seed. Parameters
// under stage3_param_persistence_threshold stay whole (the engine keeps them
// gathered anyway). With offload_param nvme, the shards beyond
// offload_param.max_in_cpu are written to the parameter swap file as their
// layers are built, so host memory holds one layer at a time, not the
// partition (NOTE [parameter swapping]). A partitioned module must be a layer of the model the
// engine is given: a child of a ModuleList or Sequential, or in
// InitOptions::layers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "zero/config/config.h"
#include "zero/runtime/engine.h"
#include "zero/core/memory_ledger.h"

namespace zero {

/// Partitioned construction for ZeRO stage 3 (DeepSpeed's zero.Init; see
/// the top of this file): each layer given to partition() keeps only this
/// rank's shard, and zero::initialize(model, init) builds the engine on
/// those shards. Not copyable. Not thread-safe: one thread builds the
/// model through it, one call at a time. Throws as each method says
/// (zero::Error kinds, zero/core/error.h).
class Init {
 public:
  /// Reads the config (a path, or JSON text starting with '{'), which must ask
  /// for stage 3, and resolves the device as the engine will (InitOptions).
  /// Throws ConfigError (not stage 3, a bad config), IoError.
  explicit Init(const std::string& config, InitOptions options = {});
  /// Frees the shards no engine took over; the partitioned modules'
  /// parameters stay empty.
  ~Init();
  Init(const Init&) = delete;
  Init& operator=(const Init&) = delete;

  /// Partitions `module`'s parameters now; returns it for chaining (a
  /// module holder, TORCH_MODULE's, or a shared_ptr to a module).
  /// `name`: where the module sits in the model ("model.layers.3"), for
  /// InitOptions::trainable (which sees "model.layers.3.q_proj.weight").
  template <typename Holder>
  Holder partition(Holder module, const std::string& name = "") {
    if constexpr (requires { module.ptr(); }) partition_module(module.ptr(), name);
    else partition_module(std::shared_ptr<torch::nn::Module>(module), name);
    return module;
  }
  /// Keeps this rank's chunk of `module`'s parameters (on the device, in host
  /// memory with offload_param, or written to the parameter swap file past
  /// offload_param.max_in_cpu) and empties the parameters: the trainable
  /// ones in one shard, the frozen ones in another (NOTE [frozen groups]),
  /// each parameter first set trainable or frozen by InitOptions::trainable
  /// when given (by `name`.its name in the module). Throws OutOfMemoryError,
  /// IoError, ConfigError (offload_param.buffer_size below the shard, a bad
  /// nvme_path), UsageError after initialize took this Init.
  void partition_module(const std::shared_ptr<torch::nn::Module>& module, const std::string& name = "");

  /// Where the shards are counted; the engine goes on with this ledger.
  MemoryLedger& ledger();
  /// The config read by the constructor; valid while the Init lives.
  const config::Config& config() const;
  /// The options given to the constructor, the job (InitOptions::dist)
  /// filled in; initialize(model, init) builds the engine with them.
  const InitOptions& options() const;

 private:
  friend Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& layers,
                           torch::optim::Optimizer* optimizer);
  std::shared_ptr<InitState> state_;
};

/// initialize(model, init) for a model declared with TORCH_MODULE (a ModuleHolder).
template <typename M>
Engine initialize(torch::nn::ModuleHolder<M>& model, Init& init) {
  return initialize(model.ptr(), init);
}

}  // namespace zero
