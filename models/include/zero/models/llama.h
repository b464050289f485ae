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
  /// vocab_size: tokens in the vocabulary (rows of embed_tokens and lm_head).
  int64_t vocab_size = 32000;
  /// hidden_size: width of the hidden states, in elements.
  int64_t hidden_size = 4096;
  /// intermediate_size: inner width of each layer's MLP, in elements.
  int64_t intermediate_size = 11008;
  /// num_hidden_layers: decoder layers.
  int64_t num_hidden_layers = 32;
  /// num_attention_heads: query heads of each attention.
  int64_t num_attention_heads = 32;
  /// num_key_value_heads: fewer than the heads: grouped-query attention
  /// (from_file: num_attention_heads when absent).
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;            ///< head_dim: elements per head; hidden_size / num_attention_heads unless given.
  /// max_position_embeddings: the longest sequence the model is meant for, in
  /// tokens (recorded and written back; the modules do not check it).
  int64_t max_position_embeddings = 2048;
  /// rms_norm_eps: epsilon added to the mean square in every RMSNorm.
  double rms_norm_eps = 1e-6;
  /// rope_theta (transformers 5: rope_parameters.rope_theta): base of the
  /// rotary embeddings' frequencies.
  double rope_theta = 10000.0;
  /// rope_type "default", or "llama3" with its frequency scaling.
  std::string rope_type = "default";
  /// rope_scaling.factor (transformers 5: rope_parameters.factor): how much
  /// the low frequencies are divided by; rope_type "llama3" only.
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  /// @var zero::models::LlamaConfig::rope_low_freq_factor
  /// rope_scaling.low_freq_factor (transformers 5: rope_parameters.low_freq_factor);
  /// rope_type "llama3" only.
  /// @var zero::models::LlamaConfig::rope_high_freq_factor
  /// rope_scaling.high_freq_factor (transformers 5: rope_parameters.high_freq_factor);
  /// rope_type "llama3" only; from_file requires it above low_freq_factor.

  /// rope_scaling.original_max_position_embeddings (transformers 5: in
  /// rope_parameters), in tokens: the context length the "llama3" frequency
  /// scaling starts from; rope_type "llama3" only.
  int64_t rope_original_max_position_embeddings = 8192;
  /// tie_word_embeddings: the output projection shares embed_tokens' weight
  /// (LlamaTiedHead) instead of having its own lm_head.weight.
  bool tie_word_embeddings = false;
  /// attention_bias: q_proj, k_proj, v_proj and o_proj have biases.
  bool attention_bias = false;
  /// mlp_bias: gate_proj, up_proj and down_proj have biases.
  bool mlp_bias = false;
  /// initializer_range: standard deviation of the normal distribution the
  /// linear and embedding weights start from.
  double initializer_range = 0.02;
  /// pad_token_id: its embedding row takes no gradient and starts at zero
  /// (nn.Embedding's padding_idx, as transformers builds it); none when unset.
  std::optional<int64_t> pad_token_id;

  /// Reads a config.json (a file, or a folder holding one): transformers 4's
  /// keys (rope_theta, rope_scaling) and 5's (rope_parameters) alike. Throws
  /// zero::ConfigError naming the file and key: another model_type or
  /// hidden_act, a missing or out-of-range size, heads that do not divide;
  /// zero::IoError when the file cannot be read.
  static LlamaConfig from_file(const std::string& path);
  /// The same from JSON text; `where` names it in messages. Throws
  /// zero::ConfigError as from_file does, and for text that is not a JSON object.
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
  int64_t r = 0;  ///< r: each adapter's rank; 0: no adapters.
  /// lora_alpha: the adapters' output is scaled by alpha / r.
  double alpha = 8.0;
  /// lora_dropout: probability of zeroing an element of an adapter's input,
  /// while training only (the base projection sees x unchanged).
  double dropout = 0.0;
  /// Module names, as PEFT's target_modules: q_proj, k_proj, v_proj,
  /// o_proj, gate_proj, up_proj, down_proj, or "all-linear" for all seven.
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  /// Seeds the adapters' own generator: the base's values do not depend on
  /// whether adapters are built.
  uint64_t seed = 0;
  /// True when adapters are built (r above 0).
  bool enabled() const { return r > 0; }
  /// alpha / r, the factor on the adapters' output; meaningful only when enabled().
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
  /// Registers `weight` itself (not a copy) as the parameter `weight`, requiring gradients.
  explicit LoraFactorImpl(const torch::Tensor& weight);
  /// x [..., in] -> x W^T [..., out].
  torch::Tensor forward(const torch::Tensor& x);
  /// The factor's matrix, [out, in] of this factor: A [r, in], B [out, r].
  torch::Tensor weight;
};
TORCH_MODULE(LoraFactor);

/// A Llama projection: y = x W^T (+ b), transformers' Linear (`weight`,
/// `bias`), with LoRA adapters when built with them (LoraConfig).
class LlamaLinearImpl : public torch::nn::Module {
 public:
  /// W ~ normal(0, std) from the global generator, b = 0; `lora` (may be
  /// null or disabled): adapters, A from `gen` (null: the global generator).
  /// W and b are left trainable here: LlamaModel and LlamaForCausalLM freeze
  /// them when adapters are built.
  LlamaLinearImpl(int64_t in, int64_t out, bool bias, double std, const LoraConfig* lora, at::Generator* gen);
  /// x [..., in] -> x W^T + b [..., out], plus lora_B(lora_A(dropout(x))) * alpha / r
  /// with adapters (dropout only while training).
  torch::Tensor forward(const torch::Tensor& x);
  /// The base weight W [out, in].
  torch::Tensor weight, bias;
  /// @var zero::models::LlamaLinearImpl::bias
  /// The base bias b [out]; undefined when built without bias.
  LoraFactor lora_A{nullptr}, lora_B{nullptr};
  /// @var zero::models::LlamaLinearImpl::lora_A
  /// The adapter's factor A [r, in]; null without adapters.
  /// @var zero::models::LlamaLinearImpl::lora_B
  /// The adapter's factor B [out, r]; null without adapters.

 private:
  double scaling_ = 0, dropout_ = 0;
};
TORCH_MODULE(LlamaLinear);

/// y = weight * x / sqrt(mean(x^2) + eps), computed in fp32.
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  /// `weight` of `size` ones; `eps` is added to the mean square (rms_norm_eps).
  LlamaRMSNormImpl(int64_t size, double eps);
  /// x [..., size] -> the same shape: normalised in fp32, cast back to x's
  /// dtype, then multiplied by `weight` (as transformers does).
  torch::Tensor forward(const torch::Tensor& x);
  /// The scale [size], starting at ones.
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
  /// Returns [B, T, C]: causal attention over all earlier positions, no padding mask.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  /// The query projection hidden_size -> num_attention_heads * head_dim
  /// (with bias when attention_bias, as the other three).
  LlamaLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  /// @var zero::models::LlamaAttentionImpl::k_proj
  /// The key projection hidden_size -> num_key_value_heads * head_dim.
  /// @var zero::models::LlamaAttentionImpl::v_proj
  /// The value projection hidden_size -> num_key_value_heads * head_dim.
  /// @var zero::models::LlamaAttentionImpl::o_proj
  /// The output projection num_attention_heads * head_dim -> hidden_size.

 private:
  int64_t heads_, kv_heads_, head_dim_;
};
TORCH_MODULE(LlamaAttention);

/// down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  /// `lora`, `gen` (may be null): adapters on the targeted projections.
  LlamaMLPImpl(const LlamaConfig& c, const LoraConfig* lora = nullptr, at::Generator* gen = nullptr);
  /// x [..., hidden_size] -> [..., hidden_size].
  torch::Tensor forward(const torch::Tensor& x);
  /// The gate projection hidden_size -> intermediate_size (with bias when
  /// mlp_bias, as the other two).
  LlamaLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  /// @var zero::models::LlamaMLPImpl::up_proj
  /// The up projection hidden_size -> intermediate_size.
  /// @var zero::models::LlamaMLPImpl::down_proj
  /// The down projection intermediate_size -> hidden_size.
};
TORCH_MODULE(LlamaMLP);

/// One decoder layer: pre-norm attention and MLP, each with a residual.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  /// `lora`, `gen` (may be null): adapters on the targeted projections.
  LlamaDecoderLayerImpl(const LlamaConfig& c, const LoraConfig* lora = nullptr, at::Generator* gen = nullptr);
  /// x [B, T, C]; cos, sin [T, head_dim]. h = x + self_attn(input_layernorm(x)),
  /// returns h + mlp(post_attention_layernorm(h)).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  /// The attention.
  LlamaAttention self_attn{nullptr};
  /// The MLP.
  LlamaMLP mlp{nullptr};
  /// The RMSNorm before the attention.
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  /// @var zero::models::LlamaDecoderLayerImpl::post_attention_layernorm
  /// The RMSNorm before the MLP.
};
TORCH_MODULE(LlamaDecoderLayer);

/// The embedding, the decoder layers and the final norm: transformers' LlamaModel.
/// `model.` prefixes its parameters' names in LlamaForCausalLM, as in transformers.
class LlamaModelImpl : public torch::nn::Module {
 public:
  /// Initialises as LlamaForCausalLM's constructor says. With `init` (not
  /// owned; may be null) partitions the embedding, each decoder layer and the
  /// norm as each is built. With `lora` enabled (not checked here) the
  /// adapters take their values from a generator seeded with LoraConfig::seed
  /// and every other parameter is frozen.
  LlamaModelImpl(const LlamaConfig& c, Init* init, const LoraConfig& lora = {});
  /// ids [B, T] int64 -> hidden states [B, T, C]. Each decoder layer runs as
  /// a stage-3 layer (zero::layer_forward), through `checkpointer` when it is
  /// set and the module is training.
  torch::Tensor forward(const torch::Tensor& ids);
  /// cos and sin [T, head_dim] of positions 0..T-1, fp32.
  std::pair<torch::Tensor, torch::Tensor> rotary(int64_t T, torch::Device device) const;
  /// The token embedding [vocab_size, hidden_size], padding_idx pad_token_id when set.
  torch::nn::Embedding embed_tokens{nullptr};
  /// The num_hidden_layers LlamaDecoderLayer modules.
  torch::nn::ModuleList layers{nullptr};
  /// The final RMSNorm.
  LlamaRMSNorm norm{nullptr};
  checkpointing::Checkpointer* checkpointer = nullptr;  ///< Not owned; null: no activation checkpointing.

 private:
  LlamaConfig config_;
  torch::Tensor inv_freq_;  // not a buffer: transformers does not save it
};
TORCH_MODULE(LlamaModel);

/// The output projection sharing the embedding's weight (tie_word_embeddings),
/// a layer of its own so stage 3 gathers it where it is used.
class LlamaTiedHeadImpl : public torch::nn::Module {
 public:
  /// Registers `weight` (the embedding's weight itself, not a copy) as the parameter `weight`.
  explicit LlamaTiedHeadImpl(const torch::Tensor& weight);
  /// x [..., hidden_size] -> logits x W^T [..., vocab_size].
  torch::Tensor forward(const torch::Tensor& x);
  /// [vocab_size, hidden_size], the same tensor as model.embed_tokens.weight.
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
  /// projections get adapters and every other parameter is frozen; a LoRA
  /// config that fails the check throws zero::ConfigError. `init` is not owned.
  LlamaForCausalLMImpl(const LlamaConfig& config, Init* init = nullptr, const LoraConfig& lora = {});
  /// ids [B, T] int64 -> logits [B, T, vocab_size].
  torch::Tensor forward(const torch::Tensor& ids);
  /// The layers outside the ModuleList, for InitOptions::layers / initialize.
  std::vector<std::shared_ptr<torch::nn::Module>> stage3_layers() const;
  /// Runs each decoder layer through `checkpointer` while training (null: off). Not owned.
  void set_checkpointer(checkpointing::Checkpointer* checkpointer) { model->checkpointer = checkpointer; }
  /// The config the model was built from.
  const LlamaConfig& config() const { return config_; }
  /// The LoRA config the model was built with (disabled when none).
  const LoraConfig& lora() const { return lora_; }
  /// True for the name of a parameter without weight decay in the usual
  /// recipe: the norms, the biases and the embedding (and the tied head,
  /// which is the embedding).
  bool no_decay(const std::string& name) const;

  /// The embedding, decoder layers and final norm.
  LlamaModel model{nullptr};
  /// The output projection hidden_size -> vocab_size, no bias, registered as
  /// `lm_head`; null when tie_word_embeddings.
  torch::nn::Linear lm_head{nullptr};
  /// The tied output projection, registered as `lm_head`; null unless tie_word_embeddings.
  LlamaTiedHead tied_head{nullptr};

 private:
  LlamaConfig config_;
  LoraConfig lora_;
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace zero::models
