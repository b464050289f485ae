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

/// MoEModel's sizes (set in code; no file or JSON key). MoEModel checks them.
struct MoEConfig {
  /// Tokens in the vocabulary (rows of the embedding, outputs of the head).
  int64_t vocab_size = 64;
  /// Width of the hidden states, in elements.
  int64_t hidden_size = 32;
  int64_t intermediate_size = 64;  ///< Inner width, in elements: each expert's.
  int64_t num_layers = 2;          ///< Number of layers: MoE blocks.
  /// Experts in each block.
  int64_t num_experts = 4;
  /// Experts each token is routed to.
  int64_t top_k = 1;
  /// Throws zero::ConfigError naming the field (a size below 1, top_k above
  /// num_experts).
  void check() const;
};

/// One expert: down(silu(gate(x)) * up(x)), as Mixtral's.
class MoEExpertImpl : public torch::nn::Module {
 public:
  /// Bias-free Linears with torch's default initialisation: gate and up
  /// hidden -> intermediate, down intermediate -> hidden.
  MoEExpertImpl(int64_t hidden, int64_t intermediate);
  /// x [..., hidden] -> [..., hidden].
  torch::Tensor forward(const torch::Tensor& x);
  /// The gate projection hidden -> intermediate.
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};
  /// @var zero::models::MoEExpertImpl::up
  /// The up projection hidden -> intermediate.
  /// @var zero::models::MoEExpertImpl::down
  /// The down projection intermediate -> hidden.
};
TORCH_MODULE(MoEExpert);

/// Top-k routing over `experts`: y = sum over the chosen experts of
/// softmax(chosen router logits) * expert(x); experts that no token chose
/// are skipped.
class MixtureOfExpertsImpl : public torch::nn::Module {
 public:
  /// A router and c.num_experts experts of c.hidden_size and
  /// c.intermediate_size, routing to c.top_k of them (`c` is not checked here).
  explicit MixtureOfExpertsImpl(const MoEConfig& c);
  /// x [N, C] tokens -> [N, C]. Each expert that gets tokens runs through
  /// zero::forward on those tokens alone.
  torch::Tensor forward(const torch::Tensor& x);
  /// The router: hidden_size -> num_experts logits, no bias.
  torch::nn::Linear router{nullptr};
  /// The num_experts MoEExpert modules.
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
  /// A LayerNorm over c.hidden_size and a MixtureOfExperts of `c`.
  explicit MoEBlockImpl(const MoEConfig& c);
  /// x [..., C] -> the same shape; norm and moe run through zero::forward,
  /// the mixture on the tokens flattened to [N, C].
  torch::Tensor forward(const torch::Tensor& x);
  /// The norm before the mixture.
  torch::nn::LayerNorm norm{nullptr};
  /// The mixture of experts.
  MixtureOfExperts moe{nullptr};
};
TORCH_MODULE(MoEBlock);

/// Embedding, MoE blocks, a final norm and head: ids [B, T] -> logits [B, T, V].
/// Each block runs through zero::forward; its router, experts and norm are
/// its own children (not a ModuleList of the model), so without leaf
/// modules the experts' ModuleList makes each expert a stage-3 layer.
class MoEModelImpl : public torch::nn::Module {
 public:
  /// Checks `c` (MoEConfig::check throws zero::ConfigError), then builds the
  /// modules with torch's default initialisation.
  explicit MoEModelImpl(const MoEConfig& c);
  /// ids [B, T] int64 -> logits [B, T, vocab_size].
  torch::Tensor forward(const torch::Tensor& ids);
  /// The blocks' mixtures: the modules to make leaf modules at stage 3.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_leaf_modules() const;
  /// The modules outside the experts that stage 3 gathers as layers (the
  /// embedding, the blocks' norms, the final norm and head), for
  /// InitOptions::layers.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_layers() const;
  /// The config the model was built from.
  const MoEConfig& config() const { return config_; }

  /// The token embedding [vocab_size, hidden_size].
  torch::nn::Embedding embed{nullptr};
  /// The num_layers blocks, registered as children block0, block1, and so on.
  std::vector<MoEBlock> blocks;
  /// The final LayerNorm.
  torch::nn::LayerNorm norm{nullptr};
  /// The output projection hidden_size -> vocab_size, no bias.
  torch::nn::Linear head{nullptr};

 private:
  MoEConfig config_;
};
TORCH_MODULE(MoEModel);

}  // namespace zero::models
