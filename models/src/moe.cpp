#include "zero/models/moe.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>

#include "zero/core/error.h"
#include "zero/partition/layer.h"

namespace zero::models {

void MoEConfig::check() const {
  std::vector<std::string> errors;
  for (const auto& [name, v] : std::vector<std::pair<std::string, int64_t>>{{"vocab_size", vocab_size},
                                                                            {"hidden_size", hidden_size},
                                                                            {"intermediate_size", intermediate_size},
                                                                            {"num_layers", num_layers},
                                                                            {"num_experts", num_experts},
                                                                            {"top_k", top_k}})
    if (v < 1) errors.push_back("MoEConfig." + name + ": expected at least 1; got " + std::to_string(v));
  if (top_k > num_experts)
    errors.push_back("MoEConfig.top_k: expected at most num_experts (" + std::to_string(num_experts) + "); got " +
                     std::to_string(top_k));
  if (!errors.empty()) throw ConfigError(errors);
}

MoEExpertImpl::MoEExpertImpl(int64_t hidden, int64_t intermediate) {
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(hidden, intermediate).bias(false)));
  up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(hidden, intermediate).bias(false)));
  down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(intermediate, hidden).bias(false)));
}

torch::Tensor MoEExpertImpl::forward(const torch::Tensor& x) {
  return down->forward(torch::silu(gate->forward(x)) * up->forward(x));
}

MixtureOfExpertsImpl::MixtureOfExpertsImpl(const MoEConfig& c) : top_k_(c.top_k) {
  router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.num_experts).bias(false)));
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < c.num_experts; ++e) experts->push_back(MoEExpert(c.hidden_size, c.intermediate_size));
}

torch::Tensor MixtureOfExpertsImpl::forward(const torch::Tensor& x) {
  const auto logits = router->forward(x);  // [N, E]
  auto [top, chosen] = logits.topk(top_k_, -1);
  auto weights = torch::softmax(top, -1).to(x.scalar_type());  // [N, k]
  if (forced_ >= 0) {
    chosen = torch::full({x.size(0), 1}, forced_, chosen.options());
    weights = torch::ones({x.size(0), 1}, x.options());
  }
  auto y = torch::zeros_like(x);
  const int64_t n_experts = static_cast<int64_t>(experts->size());
  counts_.assign(static_cast<size_t>(n_experts), 0);
  for (int64_t e = 0; e < n_experts; ++e) {
    const auto hit = chosen.eq(e);  // [N, k]
    const auto tokens = hit.any(-1).nonzero().squeeze(-1);
    counts_[static_cast<size_t>(e)] = tokens.numel();
    if (tokens.numel() == 0) continue;  // no token for this expert: it does not run
    const auto w = (weights * hit.to(weights.scalar_type())).sum(-1).index_select(0, tokens).unsqueeze(-1);
    // An expert is a layer of its own unless the mixture is a leaf module
    // (NOTE [leaf modules]): then this is its plain forward.
    const auto out = zero::forward(experts[e]->as<MoEExpert>(), x.index_select(0, tokens));
    y = y.index_add(0, tokens, out * w);
  }
  return y;
}

MoEBlockImpl::MoEBlockImpl(const MoEConfig& c) {
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size})));
  moe = register_module("moe", MixtureOfExperts(c));
}

torch::Tensor MoEBlockImpl::forward(const torch::Tensor& x) {
  const auto shape = x.sizes().vec();
  const auto h = zero::forward(norm, x).reshape({-1, shape.back()});
  return x + zero::forward(moe, h).reshape(shape);
}

MoEModelImpl::MoEModelImpl(const MoEConfig& c) : config_(c) {
  c.check();
  embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  for (int64_t i = 0; i < c.num_layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), MoEBlock(c)));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size})));
  head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
}

torch::Tensor MoEModelImpl::forward(const torch::Tensor& ids) {
  auto x = zero::forward(embed, ids);
  for (auto& b : blocks) x = b->forward(x);
  return zero::forward(head, zero::forward(norm, x));
}

std::vector<std::shared_ptr<torch::nn::Module>> MoEModelImpl::stage3_leaf_modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& b : blocks) out.push_back(b->moe.ptr());
  return out;
}

std::vector<std::shared_ptr<torch::nn::Module>> MoEModelImpl::stage3_layers() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out{embed.ptr()};
  for (const auto& b : blocks) out.push_back(b->norm.ptr());
  out.push_back(norm.ptr());
  out.push_back(head.ptr());
  return out;
}

}  // namespace zero::models
