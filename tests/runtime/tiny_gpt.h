// The addition task's GPT that the runtime tests train: 10 tokens, 6
// positions, no dropout (so that runs compare exactly). Width and heads
// are the test's; the defaults are the smallest the tests use. And what the
// engine tests share: the model from a seed, its loss, its parameters, and
// quiet CPU options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "data.h"
#include "model.h"
#include "zero/zero.h"

namespace zero::test {

inline mingpt::GPTConfig tiny_gpt_config(int64_t n_embd = 32, int64_t n_head = 2, int64_t n_layer = 2) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = n_embd;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = 0.0;
  return c;
}

/// The smallest tiny GPT, initialised from `seed`.
inline mingpt::GPT make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return mingpt::GPT(tiny_gpt_config());
}

/// Cross-entropy of the model on a batch (fp32 logits, padding ignored).
inline torch::Tensor loss_of(mingpt::GPT& model, const mingpt::Batch& b) {
  auto logits = model->forward(b.x);
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}), b.y.view({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

/// Copies of the model's parameters in fp32.
inline std::vector<torch::Tensor> flat_params(mingpt::GPT& model) {
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().to(torch::kFloat).clone());
  return out;
}

/// A config of AdamW (lr 0.003, betas 0.9/0.95, weight decay 0.01) with
/// `extra` appended (keys each preceded by a comma).
inline std::string config_json(const std::string& extra, int64_t mbs = 16, int64_t gas = 1, double clip = 0.0) {
  return R"({"train_micro_batch_size_per_gpu": )" + std::to_string(mbs) +
         R"(, "gradient_accumulation_steps": )" + std::to_string(gas) +
         R"(, "gradient_clipping": )" + std::to_string(clip) +
         R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}})" +
         extra + "}";
}

/// On the CPU, without the progress line.
inline zero::InitOptions quiet() {
  zero::InitOptions o;
  o.print_progress = false;
  o.device = torch::Device(torch::kCPU);
  return o;
}

}  // namespace zero::test
