// minGPT, the model of the minGPT max-parameter benchmark: token embedding,
// learned position embedding, n_layer pre-LayerNorm blocks of causal
// self-attention (separate key, query, value and output projections) and a
// 4x GELU MLP, a final LayerNorm and an untied head without bias.
// Parameters: P = L(12C^2 + 13C) + C(2V + T + 2).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "zero/checkpointing/checkpoint.h"

namespace zero {
class Init;
}

namespace mingpt {

struct GPTConfig {
  int64_t vocab_size = 10;
  int64_t block_size = 6;
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double embd_pdrop = 0.1;
  double resid_pdrop = 0.1;
  double attn_pdrop = 0.1;
  bool tie_weights = false;

  /// L(12C^2 + 13C) + C(2V + T + 2), less VC when tied.
  int64_t num_parameters() const {
    const int64_t C = n_embd;
    return n_layer * (12 * C * C + 13 * C) + C * ((tie_weights ? 1 : 2) * vocab_size + block_size + 2);
  }
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear key_{nullptr}, query_{nullptr}, value_{nullptr}, proj_{nullptr};
  torch::nn::Dropout resid_drop_{nullptr};
  int64_t n_head_;
  double attn_pdrop_;
};
TORCH_MODULE(CausalSelfAttention);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::Linear fc_{nullptr}, fc_proj_{nullptr};
  torch::nn::Dropout mlp_drop_{nullptr};
};
TORCH_MODULE(Block);

/// The output projection when tied: the token embedding's weight, as a layer
/// of its own (so stage 3 gathers it there too).
class TiedHeadImpl : public torch::nn::Module {
 public:
  explicit TiedHeadImpl(const torch::Tensor& weight) { weight_ = register_parameter("weight", weight); }
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::Tensor weight_;
};
TORCH_MODULE(TiedHead);

class GPTImpl : public torch::nn::Module {
 public:
  /// Initialises as minGPT does: N(0, 0.02) for Linear and Embedding weights,
  /// zero biases and position embedding, LayerNorm (1, 0). Draws from the
  /// global torch generator (seed it with torch::manual_seed). With `init`
  /// (ZeRO stage 3), each block is partitioned as soon as it is built, so no
  /// rank holds the whole model; the values are the same as without.
  explicit GPTImpl(const GPTConfig& config, zero::Init* init = nullptr);
  /// idx: [B, T] int64 token ids, T <= block_size. Returns logits [B, T, V].
  torch::Tensor forward(const torch::Tensor& idx);
  const GPTConfig& config() const { return config_; }
  /// The blocks, in order (for activation checkpointing and ZeRO-3 wrapping).
  torch::nn::ModuleList blocks() const { return blocks_; }
  /// The layers outside the ModuleList for ZeRO stage 3 (InitOptions::layers).
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_layers() const;
  /// Runs every block through `checkpointer` (null: no checkpointing). Not owned.
  void set_checkpointer(zero::checkpointing::Checkpointer* checkpointer) { checkpointer_ = checkpointer; }

 private:
  GPTConfig config_;
  torch::nn::Embedding tok_emb_{nullptr};
  torch::Tensor pos_emb_;
  torch::nn::Dropout drop_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
  TiedHead tied_head_{nullptr};
  zero::checkpointing::Checkpointer* checkpointer_ = nullptr;
};
TORCH_MODULE(GPT);

}  // namespace mingpt
