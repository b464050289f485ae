// A Llama-family decoder (Hugging Face's LlamaForCausalLM) for training
// through zero: the architecture read from a Hugging Face config.json,
// parameter names as transformers has them (so its checkpoints load with
// Engine::load_weights and Engine::save_hf writes what it loads), built
// partitioned under zero::Init at stage 3, each decoder layer a stage-3
// layer, activation checkpointing per layer.
//
//   auto cfg = zero::models::LlamaConfig::from_file("Llama-3.2-1B");   // its config.json
//   zero::models::LlamaForCausalLM model(cfg, init.get());             // init: zero::Init at stage 3, else null
//   auto engine = zero::initialize(model.ptr(), ...);                   // (layers: model->stage3_layers())
//   engine.load_weights("Llama-3.2-1B");                               // model.safetensors or its shards
//   auto logits = model->forward(ids);                                  // [B, T] -> [B, T, V]
//
// The math is transformers' (eager or sdpa attention, fp32 RMSNorm, rotary
// embeddings with Llama 3's frequency scaling), so logits agree with it to
// rounding. Not thread-safe; one training thread drives a model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "zero/runtime/estimate.h"

namespace zero {
class Init;
namespace checkpointing {
class Checkpointer;
}
}  // namespace zero

namespace zero::models {

/// LlamaForCausalLM's architecture, as its config.json says it.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // fewer than the heads: grouped-query attention
  int64_t head_dim = 128;            // hidden_size / num_attention_heads unless given
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  /// rope_type "default", or "llama3" with its frequency scaling.
  std::string rope_type = "default";
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  double initializer_range = 0.02;
  /// pad_token_id: its embedding row takes no gradient and starts at zero
  /// (nn.Embedding's padding_idx, as transformers builds it); none when unset.
  std::optional<int64_t> pad_token_id;

  /// Reads a config.json (a file, or a folder holding one): transformers 4's
  /// keys (rope_theta, rope_scaling) and 5's (rope_parameters) alike. Throws
  /// zero::ConfigError naming the file and key: another model_type or
  /// hidden_act, a missing or out-of-range size, heads that do not divide.
  static LlamaConfig from_file(const std::string& path);
  /// The same from JSON text; `where` names it in messages.
  static LlamaConfig from_json_text(const std::string& text, const std::string& where);
  /// config.json as transformers writes it (both rope key styles), which
  /// from_file and transformers read back.
  std::string to_json() const;
  /// Parameters of the model this describes (a tied head counted once).
  int64_t num_parameters() const;
};

/// LoRA adapters (PEFT's LoraConfig) on a Llama model's projections: each
/// target `X` (q_proj, ...) computes X(x) + B(A(dropout(x))) * alpha / r,
/// with A [r, in] initialised as PEFT does (kaiming_uniform with a = sqrt(5):
/// uniform(-1/sqrt(in), 1/sqrt(in))) and B [out, r] zero, so the model
/// starts as the base. The adapters are `X.lora_A.weight` and
/// `X.lora_B.weight` beside the base's `X.weight` (transformers' name, so a
/// base checkpoint loads as it is); every other parameter is frozen
/// (PEFT's bias "none"), as each layer is built (so under zero::Init the
/// base is partitioned as frozen: NOTE [frozen groups]).
struct LoraConfig {
  int64_t r = 0;  // 0: no adapters
  double alpha = 8.0;
  double dropout = 0.0;
  /// Module names, as PEFT's target_modules: q_proj, k_proj, v_proj,
  /// o_proj, gate_proj, up_proj, down_proj, or "all-linear" for all seven.
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  /// Seeds the adapters' own generator: the base's values do not depend on
  /// whether adapters are built.
  uint64_t seed = 0;
  bool enabled() const { return r > 0; }
  double scaling() const { return alpha / static_cast<double>(r); }
  /// Throws zero::ConfigError naming the field: a rank below 1 or above a
  /// target's smaller side, a target name that matches no projection, alpha
  /// or dropout out of range. Fields are named `where`.r, ... (separator
  /// '.'), or as a program's flags: `where` for r, `where` + separator +
  /// alpha, dropout, targets (llama's --lora_alpha: "--lora", '_').
  void check(const LlamaConfig& model, const std::string& where = "LoraConfig", char flag_separator = '.') const;
};

/// True for a LoRA adapter's parameter (its name has ".lora_A." or ".lora_B.").
bool is_lora_parameter(const std::string& name);

/// LlamaForCausalLM's trainable parameters, as the engine lays them out at
/// stage 3 (the model built with stage3_layers()): transformers' names, full
/// sizes, and their layers: 0 the embedding, 1..L the decoder layers, L+1
/// the final norm, L+2 the head (none when tied to the embedding). What
/// zero::estimate_model_states takes (zero estimate --hf-config).
/// With `lora` (enabled): the adapters too, and every other parameter
/// marked frozen (ParameterShape::frozen).
std::vector<ParameterShape> llama_parameters(const LlamaConfig& config, const LoraConfig& lora = {});

/// One factor of a LoRA adapter: y = x W^T, W its `weight` (A [r, in] or B [out, r]).
class LoraFactorImpl : public torch::nn::Module {
 public:
  explicit LoraFactorImpl(const torch::Tensor& weight);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
};
TORCH_MODULE(LoraFactor);

/// A Llama projection: y = x W^T (+ b), transformers' Linear (`weight`,
/// `bias`), with LoRA adapters when built with them (LoraConfig).
class LlamaLinearImpl : public torch::nn::Module {
 public:
  /// W ~ normal(0, std), b = 0; `lora` (may be null or disabled): adapters,
  /// A from `gen`, and W and b frozen.
  LlamaLinearImpl(int64_t in, int64_t out, bool bias, double std, const LoraConfig* lora, at::Generator* gen);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
  LoraFactor lora_A{nullptr}, lora_B{nullptr};  // null without adapters

 private:
  double scaling_ = 0, dropout_ = 0;
};
TORCH_MODULE(LlamaLinear);

/// y = weight * x / sqrt(mean(x^2) + eps), computed in fp32.
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(int64_t size, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(LlamaRMSNorm);

/// Multi-head attention with rotary embeddings and grouped-query heads.
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  /// `lora`, `gen` (may be null): adapters on the targeted projections.
  LlamaAttentionImpl(const LlamaConfig& c, const LoraConfig* lora = nullptr, at::Generator* gen = nullptr);
  /// x [B, T, C]; cos, sin [T, head_dim] (LlamaModel's rotary tables).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  LlamaLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
};
TORCH_MODULE(LlamaAttention);

/// down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& c, const LoraConfig* lora = nullptr, at::Generator* gen = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  LlamaLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

/// One decoder layer: pre-norm attention and MLP, each with a residual.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& c, const LoraConfig* lora = nullptr, at::Generator* gen = nullptr);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

/// The embedding, the decoder layers and the final norm (transformers'
/// LlamaModel, `model.` in the names).
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& c, Init* init, const LoraConfig& lora = {});
  /// ids [B, T] int64 -> hidden states [B, T, C].
  torch::Tensor forward(const torch::Tensor& ids);
  /// cos and sin [T, head_dim] of positions 0..T-1, fp32.
  std::pair<torch::Tensor, torch::Tensor> rotary(int64_t T, torch::Device device) const;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};
  checkpointing::Checkpointer* checkpointer = nullptr;  // not owned; null: no activation checkpointing

 private:
  LlamaConfig config_;
  torch::Tensor inv_freq_;  // not a buffer: transformers does not save it
};
TORCH_MODULE(LlamaModel);

/// The output projection sharing the embedding's weight (tie_word_embeddings),
/// a layer of its own so stage 3 gathers it where it is used.
class LlamaTiedHeadImpl : public torch::nn::Module {
 public:
  explicit LlamaTiedHeadImpl(const torch::Tensor& weight);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
};
TORCH_MODULE(LlamaTiedHead);

/// transformers' LlamaForCausalLM: `model.` and `lm_head.`.
class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  /// Initialises as transformers does (normal(0, initializer_range) for
  /// linear and embedding weights, ones for the norms) from the global torch
  /// generator (seed it the same on every rank). With `init` (ZeRO stage 3)
  /// each layer is partitioned as soon as it is built, so no rank ever holds
  /// the model whole; the values are the same as without.
  /// With `lora` enabled (checked: LoraConfig::check), the targeted
  /// projections get adapters and every other parameter is frozen.
  LlamaForCausalLMImpl(const LlamaConfig& config, Init* init = nullptr, const LoraConfig& lora = {});
  /// ids [B, T] int64 -> logits [B, T, vocab_size].
  torch::Tensor forward(const torch::Tensor& ids);
  /// The layers outside the ModuleList, for InitOptions::layers / initialize.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_layers() const;
  /// Runs each decoder layer through `checkpointer` while training (null: off). Not owned.
  void set_checkpointer(checkpointing::Checkpointer* checkpointer) { model->checkpointer = checkpointer; }
  const LlamaConfig& config() const { return config_; }
  const LoraConfig& lora() const { return lora_; }
  /// Names of the parameters without weight decay in the usual recipe:
  /// the norms and the embedding (and the tied head, which is the embedding).
  bool no_decay(const std::string& name) const;

  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};
  LlamaTiedHead tied_head{nullptr};

 private:
  LlamaConfig config_;
  LoraConfig lora_;
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace zero::models
