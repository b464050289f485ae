#include "zero/models/llama.h"

#include <cmath>
#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>

#include "zero/checkpointing/checkpoint.h"
#include "zero/core/error.h"
#include "zero/partition/layer.h"
#include "zero/runtime/init.h"

namespace zero::models {
namespace {

torch::nn::Linear linear(int64_t in, int64_t out, bool bias, double std) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(bias));
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(l->weight, 0.0, std);
  if (bias) l->bias.zero_();
  return l;
}

const std::vector<std::string> kProjections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"};

// A target of `lora`, by the projection's name.
const LoraConfig* lora_for(const LoraConfig* lora, const std::string& name) {
  if (lora == nullptr || !lora->enabled()) return nullptr;
  for (const auto& t : lora->target_modules)
    if (t == name || t == "all-linear") return lora;
  return nullptr;
}

// NOTE [frozen groups]: with LoRA, everything but the adapters is frozen, as
// each module is built (before zero::Init partitions it).
void freeze_base(torch::nn::Module& m, const LoraConfig& lora) {
  if (!lora.enabled()) return;
  for (const auto& item : m.named_parameters(true))
    if (!is_lora_parameter("." + item.key())) item.value().requires_grad_(false);
}

// transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor LlamaRMSNormImpl::forward(const torch::Tensor& x) {
  const auto x32 = x.to(torch::kFloat);
  const auto normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

LoraFactorImpl::LoraFactorImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }

torch::Tensor LoraFactorImpl::forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

void LoraConfig::check(const LlamaConfig& c, const std::string& where, char flag_separator) const {
  // A field by the name the user gave it: LoraConfig.r, or a flag (--lora,
  // --lora_alpha, --lora_targets, ... with '_' or '-').
  auto field = [&](const std::string& name, const std::string& flag_suffix) {
    if (flag_separator == '.') return where + "." + name;
    return flag_suffix.empty() ? where : where + flag_separator + flag_suffix;
  };
  std::vector<std::string> errors;
  if (r < 1) errors.push_back(field("r", "") + ": expected a rank of at least 1; got " + std::to_string(r));
  if (!(alpha > 0)) errors.push_back(field("alpha", "alpha") + ": expected a positive number; got " + std::to_string(alpha));
  if (!(dropout >= 0 && dropout < 1))
    errors.push_back(field("dropout", "dropout") + ": expected a probability in [0, 1); got " + std::to_string(dropout));
  if (target_modules.empty())
    errors.push_back(field("target_modules", "targets") + ": expected at least one of q_proj, k_proj, v_proj, o_proj, "
                     "gate_proj, up_proj, down_proj, all-linear");
  const std::map<std::string, std::pair<int64_t, int64_t>> sides = {
      {"q_proj", {c.hidden_size, c.num_attention_heads * c.head_dim}},
      {"k_proj", {c.hidden_size, c.num_key_value_heads * c.head_dim}},
      {"v_proj", {c.hidden_size, c.num_key_value_heads * c.head_dim}},
      {"o_proj", {c.num_attention_heads * c.head_dim, c.hidden_size}},
      {"gate_proj", {c.hidden_size, c.intermediate_size}},
      {"up_proj", {c.hidden_size, c.intermediate_size}},
      {"down_proj", {c.intermediate_size, c.hidden_size}}};
  for (const auto& t : target_modules) {
    if (t == "all-linear") continue;
    auto it = sides.find(t);
    if (it == sides.end()) {
      std::string hint;
      for (const auto& [name, io] : sides)
        if (name.find(t) != std::string::npos || t.find(name) != std::string::npos) hint = "; did you mean " + name + "?";
      errors.push_back(field("target_modules", "targets") + ": \"" + t + "\" matches no projection of a Llama layer (q_proj, "
                       "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or all-linear)" + hint);
      continue;
    }
    const int64_t side = std::min(it->second.first, it->second.second);
    if (r > side)
      errors.push_back(field("r", "") + ": " + std::to_string(r) + " is larger than " + t + " (" +
                       std::to_string(it->second.first) + " -> " + std::to_string(it->second.second) +
                       "): a rank of at most " + std::to_string(side) + " there");
  }
  if (!errors.empty()) throw ConfigError(errors);
}

LlamaLinearImpl::LlamaLinearImpl(int64_t in, int64_t out, bool with_bias, double std, const LoraConfig* lora,
                                 at::Generator* gen) {
  // Built as torch::nn::Linear is, then given transformers' init: the
  // global generator goes by exactly as it did for the Linear this replaces.
  torch::nn::Linear base = linear(in, out, with_bias, std);
  weight = register_parameter("weight", base->weight.detach());
  if (with_bias) bias = register_parameter("bias", base->bias.detach());
  if (lora == nullptr || !lora->enabled()) return;
  // PEFT's init: A = kaiming_uniform(a = sqrt(5)), that is uniform(-1/sqrt(in),
  // 1/sqrt(in)); B = 0 (the model starts as the base). From the adapters'
  // own generator, not the global one.
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  lora_A = register_module("lora_A", LoraFactor(torch::empty({lora->r, in}).uniform_(
                                         -bound, bound, gen != nullptr ? std::optional<at::Generator>(*gen) : std::nullopt)));
  lora_B = register_module("lora_B", LoraFactor(torch::zeros({out, lora->r})));
  scaling_ = lora->scaling();
  dropout_ = lora->dropout;
}

torch::Tensor LlamaLinearImpl::forward(const torch::Tensor& x) {
  auto y = torch::nn::functional::linear(x, weight, bias);
  if (!lora_A) return y;
  const auto in = dropout_ > 0 ? torch::dropout(x, dropout_, is_training()) : x;
  return y + lora_B->forward(lora_A->forward(in)) * scaling_;
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, const LoraConfig* lora, at::Generator* gen)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
  const double std = c.initializer_range;
  const bool b = c.attention_bias;
  q_proj = register_module("q_proj", LlamaLinear(c.hidden_size, heads_ * head_dim_, b, std, lora_for(lora, "q_proj"), gen));
  k_proj = register_module("k_proj", LlamaLinear(c.hidden_size, kv_heads_ * head_dim_, b, std, lora_for(lora, "k_proj"), gen));
  v_proj = register_module("v_proj", LlamaLinear(c.hidden_size, kv_heads_ * head_dim_, b, std, lora_for(lora, "v_proj"), gen));
  o_proj = register_module("o_proj", LlamaLinear(heads_ * head_dim_, c.hidden_size, b, std, lora_for(lora, "o_proj"), gen));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = q_proj->forward(x).view({B, T, heads_, head_dim_}).transpose(1, 2);
  auto k = k_proj->forward(x).view({B, T, kv_heads_, head_dim_}).transpose(1, 2);
  auto v = v_proj->forward(x).view({B, T, kv_heads_, head_dim_}).transpose(1, 2);
  // Rotary position embedding of queries and keys (cos, sin: [T, head_dim]).
  const auto c = cos.unsqueeze(0).unsqueeze(0), s = sin.unsqueeze(0).unsqueeze(0);
  q = q * c + rotate_half(q) * s;
  k = k * c + rotate_half(k) * s;
  if (kv_heads_ != heads_) {  // grouped-query attention: each key/value head serves heads_/kv_heads_ query heads
    k = k.repeat_interleave(heads_ / kv_heads_, 1);
    v = v.repeat_interleave(heads_ / kv_heads_, 1);
  }
  auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  return o_proj->forward(y.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, const LoraConfig* lora, at::Generator* gen) {
  const double std = c.initializer_range;
  const bool b = c.mlp_bias;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  gate_proj = register_module("gate_proj", LlamaLinear(H, I, b, std, lora_for(lora, "gate_proj"), gen));
  up_proj = register_module("up_proj", LlamaLinear(H, I, b, std, lora_for(lora, "up_proj"), gen));
  down_proj = register_module("down_proj", LlamaLinear(I, H, b, std, lora_for(lora, "down_proj"), gen));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return down_proj->forward(torch::silu(gate_proj->forward(x)) * up_proj->forward(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, const LoraConfig* lora, at::Generator* gen) {
  self_attn = register_module("self_attn", LlamaAttention(c, lora, gen));
  mlp = register_module("mlp", LlamaMLP(c, lora, gen));
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto h = x + self_attn->forward(input_layernorm->forward(x), cos, sin);
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, Init* init, const LoraConfig& lora) : config_(c) {
  auto embed = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
  if (c.pad_token_id) embed.padding_idx(*c.pad_token_id);
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(embed));
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(embed_tokens->weight, 0.0, c.initializer_range);
    if (c.pad_token_id) embed_tokens->weight[*embed_tokens->options.padding_idx()].zero_();
  }
  freeze_base(*embed_tokens, lora);
  if (init != nullptr) init->partition(embed_tokens, "model.embed_tokens");
  layers = register_module("layers", torch::nn::ModuleList());
  // The adapters' own random stream: the base's values are those of a model
  // built without them.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(lora.seed);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LlamaDecoderLayer layer(c, &lora, &gen);
    freeze_base(*layer, lora);
    layers->push_back(init != nullptr ? init->partition(layer, "model.layers." + std::to_string(i)) : layer);
  }
  norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
  freeze_base(*norm, lora);
  if (init != nullptr) init->partition(norm, "model.norm");
  // Rotary frequencies, as transformers computes them (fp32 from an int64 range).
  const int64_t d = c.head_dim;
  inv_freq_ = 1.0 / torch::pow(torch::tensor(c.rope_theta, torch::kDouble).to(torch::kFloat),
                               torch::arange(0, d, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(d));
  if (c.rope_type == "llama3") {
    const double old_len = static_cast<double>(c.rope_original_max_position_embeddings);
    const double low_wavelen = old_len / c.rope_low_freq_factor, high_wavelen = old_len / c.rope_high_freq_factor;
    const auto wavelen = 2 * M_PI / inv_freq_;
    auto scaled = torch::where(wavelen > low_wavelen, inv_freq_ / c.rope_factor, inv_freq_);
    const auto smooth = (old_len / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
    const auto smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
    const auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq_ = torch::where(medium, smoothed, scaled);
  }
}

std::pair<torch::Tensor, torch::Tensor> LlamaModelImpl::rotary(int64_t T, torch::Device device) const {
  const auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kFloat).device(device));
  const auto freqs = torch::outer(positions, inv_freq_.to(device));
  const auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& ids) {
  auto x = zero::forward(embed_tokens, ids);
  auto [cos, sin] = rotary(ids.size(1), x.device());
  cos = cos.to(x.scalar_type());
  sin = sin.to(x.scalar_type());
  for (const auto& item : *layers) {
    auto* layer = item->as<LlamaDecoderLayer>();
    checkpointing::Function run = [layer](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{layer->forward(in[0], in[1], in[2])};
    };
    if (checkpointer != nullptr && is_training()) {
      run = [this, inner = run](const std::vector<at::Tensor>& in) { return checkpointer->checkpoint(inner, in); };
    }
    x = zero::layer_forward(*layer, {x, cos, sin}, run).at(0);
  }
  return zero::forward(norm, x);
}

LlamaTiedHeadImpl::LlamaTiedHeadImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }

torch::Tensor LlamaTiedHeadImpl::forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c, Init* init, const LoraConfig& lora)
    : config_(c), lora_(lora) {
  if (lora.enabled()) lora.check(c);
  model = register_module("model", LlamaModel(c, init, lora));
  if (c.tie_word_embeddings) {
    tied_head = register_module("lm_head", LlamaTiedHead(model->embed_tokens->weight));
  } else {
    lm_head = register_module("lm_head", linear(c.hidden_size, c.vocab_size, false, c.initializer_range));
    freeze_base(*lm_head, lora);
    if (init != nullptr) init->partition(lm_head, "lm_head");
  }
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& ids) {
  const auto h = model->forward(ids);
  return tied_head ? zero::forward(tied_head, h) : zero::forward(lm_head, h);
}

std::vector<std::shared_ptr<torch::nn::Module>> LlamaForCausalLMImpl::stage3_layers() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out{model->embed_tokens.ptr(), model->norm.ptr()};
  out.push_back(tied_head ? std::static_pointer_cast<torch::nn::Module>(tied_head.ptr())
                          : std::static_pointer_cast<torch::nn::Module>(lm_head.ptr()));
  return out;
}

bool LlamaForCausalLMImpl::no_decay(const std::string& name) const {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends_with("norm.weight") || name == "model.embed_tokens.weight" || ends_with(".bias") ||
         (config_.tie_word_embeddings && name == "lm_head.weight");
}

}  // namespace zero::models
