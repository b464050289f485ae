#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/models/llama.h"

namespace zero::models {
namespace {

using Json = nlohmann::json;

// Reads the keys of config.json, collecting every problem of the file.
class Reader {
 public:
  Reader(const Json& j, std::string where) : j_(j), where_(std::move(where)) {}

  void integer(const char* key, int64_t& out, int64_t lo, int64_t hi, bool required) {
    if (!j_.contains(key) || j_.at(key).is_null()) {
      if (required) problem(key, "missing (expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + ")");
      return;
    }
    const Json& v = j_.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      problem(key, "expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + "; got " + v.dump());
      return;
    }
    out = v.get<int64_t>();
  }
  void number(const Json& j, const std::string& key, double& out, double lo, double hi) {
    if (!j.contains(key) || j.at(key).is_null()) return;
    const Json& v = j.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo || v.get<double>() > hi) {
      problem(key, "expected a number in [" + fmt(lo) + ", " + fmt(hi) + "]; got " + v.dump());
      return;
    }
    out = v.get<double>();
  }
  void boolean(const char* key, bool& out) {
    if (!j_.contains(key) || j_.at(key).is_null()) return;
    if (!j_.at(key).is_boolean()) return problem(key, "expected true or false; got " + j_.at(key).dump());
    out = j_.at(key).get<bool>();
  }
  void problem(const std::string& key, const std::string& text) { problems_.push_back(where_ + ": " + key + ": " + text); }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  static std::string fmt(double d) {
    std::ostringstream s;
    s << d;
    return s.str();
  }
  const Json& j_;
  std::string where_;
  std::vector<std::string> problems_;
};

}  // namespace

LlamaConfig LlamaConfig::from_file(const std::string& path_in) {
  struct stat st {};
  const std::string path = ::stat(path_in.c_str(), &st) == 0 && S_ISDIR(st.st_mode) ? path_in + "/config.json" : path_in;
  if (const std::string problem = input_file_problem("Hugging Face config", path); !problem.empty())
    throw IoError(problem);
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot read it (a Hugging Face config.json): " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  return from_json_text(text.str(), path);
}

LlamaConfig LlamaConfig::from_json_text(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw ConfigError({where + ": not valid JSON (" + std::string(e.what()) + ")"}, "the Hugging Face config " + where);
  }
  if (!j.is_object())
    throw ConfigError({where + ": expected a JSON object (a Hugging Face config.json)"}, "the Hugging Face config " + where);
  LlamaConfig c;
  Reader r(j, where);
  // What zero::models builds is LlamaForCausalLM: another family's config
  // (Mistral's, Gemma's), with or without its model_type, is refused by the
  // keys that would change the arithmetic, not read as a Llama.
  if (j.contains("model_type") && j.at("model_type") != "llama")
    r.problem("model_type", "expected \"llama\" (zero::models builds LlamaForCausalLM only); got " +
                                j.at("model_type").dump());
  if (j.contains("architectures") && !j.at("architectures").is_null()) {
    const Json& a = j.at("architectures");
    bool llama = a.is_array() && !a.empty();
    for (const auto& name : a.is_array() ? a : Json::array()) llama = llama && name == "LlamaForCausalLM";
    if (!llama)
      r.problem("architectures", "expected [\"LlamaForCausalLM\"] (zero::models builds LlamaForCausalLM only); got " +
                                     a.dump());
  }
  if (j.contains("hidden_act") && j.at("hidden_act") != "silu")
    r.problem("hidden_act", "expected \"silu\" (Llama's SwiGLU); got " + j.at("hidden_act").dump());
  if (j.contains("hidden_activation") && !j.at("hidden_activation").is_null() && j.at("hidden_activation") != "silu")
    r.problem("hidden_activation", "expected \"silu\" (Llama's SwiGLU; Gemma's GELU is not built); got " +
                                       j.at("hidden_activation").dump());
  const bool window_off = j.contains("use_sliding_window") && j.at("use_sliding_window") == false;
  if (j.contains("sliding_window") && !j.at("sliding_window").is_null() && !window_off)
    r.problem("sliding_window", "Llama attends to every earlier token; zero::models has no sliding-window attention "
                                "(Mistral's, Gemma's); got " + j.at("sliding_window").dump());
  for (const char* key : {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"})
    if (j.contains(key) && !j.at(key).is_null())
      r.problem(key, std::string("a key of Gemma's attention, which zero::models does not build (it builds "
                                 "LlamaForCausalLM); got ") + j.at(key).dump());
  constexpr int64_t kBig = int64_t{1} << 30;
  r.integer("vocab_size", c.vocab_size, 1, kBig, true);
  if (j.contains("pad_token_id") && !j.at("pad_token_id").is_null()) {
    int64_t pad = INT64_MIN;  // stays so when the value is refused
    r.integer("pad_token_id", pad, -c.vocab_size, c.vocab_size - 1, false);  // nn.Embedding's range
    if (pad != INT64_MIN) c.pad_token_id = pad;
  }
  r.integer("hidden_size", c.hidden_size, 1, int64_t{1} << 20, true);
  r.integer("intermediate_size", c.intermediate_size, 1, int64_t{1} << 24, true);
  r.integer("num_hidden_layers", c.num_hidden_layers, 1, 100000, true);
  r.integer("num_attention_heads", c.num_attention_heads, 1, int64_t{1} << 16, true);
  c.num_key_value_heads = c.num_attention_heads;
  r.integer("num_key_value_heads", c.num_key_value_heads, 1, int64_t{1} << 16, false);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  r.integer("head_dim", c.head_dim, 1, int64_t{1} << 16, false);
  r.integer("max_position_embeddings", c.max_position_embeddings, 1, kBig, false);
  r.number(j, "rms_norm_eps", c.rms_norm_eps, 0, 1);
  r.number(j, "initializer_range", c.initializer_range, 0, 10);
  r.boolean("tie_word_embeddings", c.tie_word_embeddings);
  r.boolean("attention_bias", c.attention_bias);
  r.boolean("mlp_bias", c.mlp_bias);
  // Rotary embeddings: transformers 4 has rope_theta and rope_scaling at the
  // top; 5 has both in rope_parameters.
  r.number(j, "rope_theta", c.rope_theta, 1, 1e12);
  Json scaling = j.contains("rope_parameters") && j.at("rope_parameters").is_object() ? j.at("rope_parameters")
                 : j.contains("rope_scaling") && j.at("rope_scaling").is_object()      ? j.at("rope_scaling")
                                                                                       : Json::object();
  r.number(scaling, "rope_theta", c.rope_theta, 1, 1e12);
  const std::string type_key = scaling.contains("rope_type") ? "rope_type" : "type";
  if (scaling.contains(type_key)) {
    if (!scaling.at(type_key).is_string() ||
        (scaling.at(type_key) != "default" && scaling.at(type_key) != "llama3"))
      r.problem("rope " + type_key, "expected \"default\" or \"llama3\"; got " + scaling.at(type_key).dump());
    else
      c.rope_type = scaling.at(type_key).get<std::string>();
  }
  if (c.rope_type == "llama3") {
    r.number(scaling, "factor", c.rope_factor, 1e-6, 1e6);
    r.number(scaling, "low_freq_factor", c.rope_low_freq_factor, 1e-6, 1e6);
    r.number(scaling, "high_freq_factor", c.rope_high_freq_factor, 1e-6, 1e6);
    if (scaling.contains("original_max_position_embeddings") &&
        scaling.at("original_max_position_embeddings").is_number_integer())
      c.rope_original_max_position_embeddings = scaling.at("original_max_position_embeddings").get<int64_t>();
    if (c.rope_high_freq_factor <= c.rope_low_freq_factor)
      r.problem("rope high_freq_factor", "expected more than low_freq_factor " + std::to_string(c.rope_low_freq_factor));
  }
  if (r.problems().empty()) {
    if (c.num_attention_heads % c.num_key_value_heads != 0)
      r.problem("num_key_value_heads", std::to_string(c.num_key_value_heads) + " does not divide num_attention_heads " +
                                           std::to_string(c.num_attention_heads));
    if (c.head_dim % 2 != 0) r.problem("head_dim", "expected an even size (rotary embeddings pair its halves); got " +
                                                       std::to_string(c.head_dim));
    // Each key is in range, their product need not be: counted in long
    // double, a model past 1e15 parameters (whose states' bytes would not
    // fit an int64) is refused, naming the values, rather than wrapped.
    using LD = long double;
    const LD C = static_cast<LD>(c.hidden_size), q = static_cast<LD>(c.num_attention_heads) * static_cast<LD>(c.head_dim),
             kv = static_cast<LD>(c.num_key_value_heads) * static_cast<LD>(c.head_dim);
    const LD n = static_cast<LD>(c.vocab_size) * C * (c.tie_word_embeddings ? 1 : 2) +
                 static_cast<LD>(c.num_hidden_layers) *
                     (2 * C * q + 2 * C * kv + 3 * C * static_cast<LD>(c.intermediate_size) + 2 * C) +
                 C;
    if (n > 1e15L) {
      char count[32];
      std::snprintf(count, sizeof count, "%.3Lg", n);
      r.problem("(the model's size)", std::string(count) + " parameters from hidden_size " + std::to_string(c.hidden_size) +
                                          ", num_attention_heads " + std::to_string(c.num_attention_heads) + " x head_dim " +
                                          std::to_string(c.head_dim) + ", num_key_value_heads " +
                                          std::to_string(c.num_key_value_heads) + ", intermediate_size " +
                                          std::to_string(c.intermediate_size) + ", num_hidden_layers " +
                                          std::to_string(c.num_hidden_layers) + ", vocab_size " +
                                          std::to_string(c.vocab_size) + ": expected at most 1e15");
    }
  }
  if (!r.problems().empty()) throw ConfigError(r.problems(), "the Hugging Face config " + where);
  return c;
}

std::string LlamaConfig::to_json() const {
  Json rope = {{"rope_theta", rope_theta}, {"rope_type", rope_type}};
  Json legacy_scaling = nullptr;
  if (rope_type == "llama3") {
    rope["factor"] = rope_factor;
    rope["low_freq_factor"] = rope_low_freq_factor;
    rope["high_freq_factor"] = rope_high_freq_factor;
    rope["original_max_position_embeddings"] = rope_original_max_position_embeddings;
    legacy_scaling = rope;
    legacy_scaling.erase("rope_theta");
  }
  const Json j = {{"architectures", {"LlamaForCausalLM"}},
                  {"model_type", "llama"},
                  {"vocab_size", vocab_size},
                  {"hidden_size", hidden_size},
                  {"intermediate_size", intermediate_size},
                  {"num_hidden_layers", num_hidden_layers},
                  {"num_attention_heads", num_attention_heads},
                  {"num_key_value_heads", num_key_value_heads},
                  {"head_dim", head_dim},
                  {"max_position_embeddings", max_position_embeddings},
                  {"rms_norm_eps", rms_norm_eps},
                  {"hidden_act", "silu"},
                  {"initializer_range", initializer_range},
                  {"tie_word_embeddings", tie_word_embeddings},
                  {"attention_bias", attention_bias},
                  {"attention_dropout", 0.0},
                  {"mlp_bias", mlp_bias},
                  {"rope_theta", rope_theta},
                  {"rope_scaling", legacy_scaling},
                  {"rope_parameters", rope},
                  {"pad_token_id", pad_token_id ? Json(*pad_token_id) : Json(nullptr)},
                  {"torch_dtype", "float32"}};
  return j.dump(2) + "\n";
}

int64_t LlamaConfig::num_parameters() const {
  const int64_t C = hidden_size, kv = num_key_value_heads * head_dim, q = num_attention_heads * head_dim;
  const int64_t attn = C * q + 2 * C * kv + q * C + (attention_bias ? q + 2 * kv + C : 0);
  const int64_t mlp = 3 * C * intermediate_size + (mlp_bias ? 2 * intermediate_size + C : 0);
  const int64_t layer = attn + mlp + 2 * C;
  return vocab_size * C * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + C;
}

std::vector<ParameterShape> llama_parameters(const LlamaConfig& c, const LoraConfig& lora) {
  std::vector<ParameterShape> out;
  const bool frozen_base = lora.enabled();
  auto add = [&](const std::string& name, int64_t numel, int layer) { out.push_back({name, numel, layer, frozen_base}); };
  // A projection, then its adapters when targeted (in the order LlamaLinear registers them).
  auto add_projection = [&](const std::string& prefix, const std::string& short_name, int64_t in, int64_t outs,
                            bool bias, int layer) {
    add(prefix + ".weight", in * outs, layer);
    if (bias) add(prefix + ".bias", outs, layer);
    if (!lora.enabled()) return;
    for (const auto& t : lora.target_modules) {
      if (t != short_name && t != "all-linear") continue;
      out.push_back({prefix + ".lora_A.weight", lora.r * in, layer, false});
      out.push_back({prefix + ".lora_B.weight", outs * lora.r, layer, false});
      break;
    }
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  add("model.embed_tokens.weight", c.vocab_size * H, 0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const int layer = static_cast<int>(l) + 1;
    // In the order the layer registers them: attention, MLP, the two norms.
    for (const auto& [name, in, outs] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
             {"q_proj", H, q}, {"k_proj", H, kv}, {"v_proj", H, kv}, {"o_proj", q, H}})
      add_projection(p + "self_attn." + name, name, in, outs, c.attention_bias, layer);
    for (const auto& [name, in, outs] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
             {"gate_proj", H, I}, {"up_proj", H, I}, {"down_proj", I, H}})
      add_projection(p + "mlp." + name, name, in, outs, c.mlp_bias, layer);
    add(p + "input_layernorm.weight", H, layer);
    add(p + "post_attention_layernorm.weight", H, layer);
  }
  const int last = static_cast<int>(c.num_hidden_layers) + 1;
  add("model.norm.weight", H, last);
  if (!c.tie_word_embeddings) add("lm_head.weight", H * c.vocab_size, last + 1);
  return out;
}

}  // namespace zero::models
