// A mixture-of-experts language model, the example of a layer whose parts
// run by the data (NOTE [leaf modules]): each MoE block routes every token
// to its top-k experts (Mixtral's routing: softmax over the chosen logits),
// and an expert that gets no token on this rank does not run. At ZeRO stage
// 3 that makes ranks gather different experts, unless the block is a leaf
// module: stage3_leaf_modules() lists the blocks, for InitOptions::leaf_modules
// (or zero::set_leaf on each).
//
//   zero::models::MoEConfig cfg;            // vocab, width, experts, top-k
//   zero::models::MoEModel model(cfg);
//   zero::InitOptions o;
//   o.leaf_modules = model->stage3_leaf_modules();
//   auto engine = zero::initialize(model.ptr(), "ds_config.json", o);
//
// Not thread-safe; one training thread drives a model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace zero::models {

struct MoEConfig {
  int64_t vocab_size = 64;
  int64_t hidden_size = 32;
  int64_t intermediate_size = 64;  // each expert's
  int64_t num_layers = 2;          // MoE blocks
  int64_t num_experts = 4;
  int64_t top_k = 1;
  /// Throws zero::ConfigError naming the field (a size below 1, top_k above
  /// num_experts).
  void check() const;
};

/// One expert: down(silu(gate(x)) * up(x)), as Mixtral's.
class MoEExpertImpl : public torch::nn::Module {
 public:
  MoEExpertImpl(int64_t hidden, int64_t intermediate);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(MoEExpert);

/// Top-k routing over `experts`: y = sum over the chosen experts of
/// softmax(chosen router logits) * expert(x); experts that no token chose
/// are skipped.
class MixtureOfExpertsImpl : public torch::nn::Module {
 public:
  explicit MixtureOfExpertsImpl(const MoEConfig& c);
  /// x [N, C] tokens -> [N, C].
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear router{nullptr};
  torch::nn::ModuleList experts{nullptr};
  /// Tokens routed to each expert by the last forward (its top-k choices).
  const std::vector<int64_t>& last_counts() const { return counts_; }
  /// Sends every token to expert `e` alone, weight 1 (-1: the router
  /// decides): a rank whose tokens all go one way, for tests and examples.
  void force_expert(int64_t e) { forced_ = e; }

 private:
  int64_t top_k_;
  int64_t forced_ = -1;
  std::vector<int64_t> counts_;
};
TORCH_MODULE(MixtureOfExperts);

/// Pre-norm residual block: x + moe(norm(x)).
class MoEBlockImpl : public torch::nn::Module {
 public:
  explicit MoEBlockImpl(const MoEConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm norm{nullptr};
  MixtureOfExperts moe{nullptr};
};
TORCH_MODULE(MoEBlock);

/// Embedding, MoE blocks, a final norm and head: ids [B, T] -> logits [B, T, V].
/// Each block runs through zero::forward; its router, experts and norm are
/// its own children (not a ModuleList of the model), so without leaf
/// modules the experts' ModuleList makes each expert a stage-3 layer.
class MoEModelImpl : public torch::nn::Module {
 public:
  explicit MoEModelImpl(const MoEConfig& c);
  torch::Tensor forward(const torch::Tensor& ids);
  /// The blocks' mixtures: the modules to make leaf modules at stage 3.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_leaf_modules() const;
  /// The modules outside the experts that stage 3 gathers as layers (the
  /// embedding, the blocks' norms, the final norm and head), for
  /// InitOptions::layers.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_layers() const;
  const MoEConfig& config() const { return config_; }

  torch::nn::Embedding embed{nullptr};
  std::vector<MoEBlock> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  MoEConfig config_;
};
TORCH_MODULE(MoEModel);

}  // namespace zero::models
