#include "model.h"

#include <functional>

#include <torch/nn/functional/linear.h>

#include "zero/runtime/init.h"
#include "zero/partition/layer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>

namespace mingpt {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& c)
    : n_head_(c.n_head), attn_pdrop_(c.attn_pdrop) {
  TORCH_CHECK(c.n_embd % c.n_head == 0, "n_embd (", c.n_embd, ") must be a multiple of n_head (",
              c.n_head, ")");
  key_ = register_module("key", torch::nn::Linear(c.n_embd, c.n_embd));
  query_ = register_module("query", torch::nn::Linear(c.n_embd, c.n_embd));
  value_ = register_module("value", torch::nn::Linear(c.n_embd, c.n_embd));
  proj_ = register_module("proj", torch::nn::Linear(c.n_embd, c.n_embd));
  resid_drop_ = register_module("resid_drop", torch::nn::Dropout(c.resid_pdrop));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const auto B = x.size(0), T = x.size(1), C = x.size(2);
  auto heads = [&](const torch::Tensor& t) {
    return t.view({B, T, n_head_, C / n_head_}).transpose(1, 2);  // [B, nh, T, hs]
  };
  auto k = heads(key_->forward(x));
  auto q = heads(query_->forward(x));
  auto v = heads(value_->forward(x));
  auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{},
                                            is_training() ? attn_pdrop_ : 0.0, /*is_causal=*/true);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return resid_drop_->forward(proj_->forward(y));
}

BlockImpl::BlockImpl(const GPTConfig& c) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  attn_ = register_module("attn", CausalSelfAttention(c));
  fc_ = register_module("fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd));
  fc_proj_ = register_module("fc_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd));
  mlp_drop_ = register_module("mlp_drop", torch::nn::Dropout(c.resid_pdrop));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn_->forward(ln1_->forward(x));
  return h + mlp_drop_->forward(fc_proj_->forward(torch::gelu(fc_->forward(ln2_->forward(h)))));
}

namespace {

// minGPT's initialisation of `m` and everything in it.
void init_weights(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& sub : m.modules(/*include_self=*/true)) {
    if (auto* lin = sub->as<torch::nn::Linear>()) {
      torch::nn::init::normal_(lin->weight, 0.0, 0.02);
      if (lin->bias.defined()) lin->bias.zero_();
    } else if (auto* emb = sub->as<torch::nn::Embedding>()) {
      torch::nn::init::normal_(emb->weight, 0.0, 0.02);
    } else if (auto* ln = sub->as<torch::nn::LayerNorm>()) {
      ln->weight.fill_(1.0);
      ln->bias.zero_();
    }
  }
}

}  // namespace

// Each part is initialised as soon as it is built, so a block can be
// partitioned before the next one exists; the random draws come in the same
// order with and without `init`.
GPTImpl::GPTImpl(const GPTConfig& c, zero::Init* init) : config_(c) {
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(c.vocab_size, c.n_embd));
  init_weights(*tok_emb_);
  pos_emb_ = register_parameter("pos_emb", torch::zeros({1, c.block_size, c.n_embd}));
  drop_ = register_module("drop", torch::nn::Dropout(c.embd_pdrop));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    Block block(c);
    init_weights(*block);
    blocks_->push_back(init != nullptr ? init->partition(block) : block);
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  init_weights(*ln_f_);
  if (c.tie_weights) {
    tied_head_ = register_module("head", TiedHead(tok_emb_->weight));
  } else {
    head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, c.vocab_size).bias(false)));
    init_weights(*head_);
  }
}

torch::Tensor TiedHeadImpl::forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight_); }

std::vector<std::shared_ptr<torch::nn::Module>> GPTImpl::stage3_layers() const {
  std::vector<std::shared_ptr<torch::nn::Module>> layers{tok_emb_.ptr(), ln_f_.ptr()};
  if (head_) layers.push_back(head_.ptr());
  if (tied_head_) layers.push_back(tied_head_.ptr());
  return layers;
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  const auto T = idx.size(1);
  TORCH_CHECK(T <= config_.block_size, "sequence length ", T, " exceeds block_size ",
              config_.block_size);
  // Each layer runs through zero::forward / layer_forward: under ZeRO stage 3
  // that gathers its parameters; otherwise it is a plain call.
  auto x = drop_->forward(zero::forward(tok_emb_, idx) + pos_emb_.narrow(1, 0, T));
  for (const auto& item : *blocks_) {
    auto* block = item->as<Block>();
    std::function<torch::Tensor(const torch::Tensor&)> run = [block](const torch::Tensor& t) {
      return block->forward(t);
    };
    if (checkpointer_ != nullptr && is_training()) {
      run = [this, block](const torch::Tensor& t) {
        return checkpointer_->checkpoint(
            zero::checkpointing::UnaryFunction([block](const torch::Tensor& u) { return block->forward(u); }), t);
      };
    }
    x = zero::layer_forward(*block, x, run);
  }
  x = zero::forward(ln_f_, x);
  return tied_head_ ? zero::forward(tied_head_, x) : zero::forward(head_, x);
}

}  // namespace mingpt
