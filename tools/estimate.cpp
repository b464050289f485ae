// zero estimate: model-state memory per rank for each ZeRO configuration, from
// the model's size or shape (runtime/include/zero/runtime/estimate.h): a
// parameter count, minGPT's shape, a Hugging Face Llama config.json, a
// weights file or a run report; with budgets the largest model whose states
// fit each configuration, and the placement of an offloaded optimizer's
// states and gradients that fits a larger one; with a run report, the peak
// of a step from its measured activations.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "tune_plan.h"
#include "zero/config/config.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/models/llama.h"
#include "zero/snapshots/checkpoint_io.h"
#include "zero/runtime/estimate.h"
#include "zero/runs/run_report.h"

namespace zero::tools {
namespace {

// Ranks in all (--ranks-per-node x --nodes): per-rank byte counts of models
// up to 1e16 parameters stay exact in int64 arithmetic up to here.
constexpr int64_t kMaxRanks = int64_t{1} << 20;

struct Setup {
  std::string name;
  int stage = 0;
  std::string offload_optimizer = "none", offload_param = "none";
  int optim_bits = 32;  // Adam's moments: 32, 16 (bf16, with a bf16 master: NOTE [16-bit master]) or 8
  bool master16 = false;  // a master in the 16-bit compute dtype (always with optim_bits 16)
  // On more than one node (NOTE [MiCS], NOTE [hpZ]): the states within
  // shard groups of `mics` ranks; stage 3's secondary partition over `hpz`;
  // ZeRO++'s quantized gathers and gradients.
  int64_t mics = 0, hpz = 0;
  bool quantized = false;
};

// A parameter count: decimal digits with an optional fraction and exponent
// and a K/M/B/G/T suffix (1.3e9, 1300M, 1.3B, 350K), whose value is a whole
// number in [1, kMaxParams]. Computed exactly from the digits: "1.5" and
// "0.5" are refused alike (no count of parameters is a fraction).
constexpr int64_t kMaxParams = 10'000'000'000'000'000;  // 1e16
std::optional<int64_t> parse_count(const std::string& s) {
  size_t i = 0;
  std::string digits;  // mantissa digits, the point removed
  int64_t frac = 0;    // digits after the point
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) digits += s[i];
  if (i < s.size() && s[i] == '.') {
    for (++i; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) digits += s[i], ++frac;
  }
  if (digits.empty() || digits.size() > 40) return std::nullopt;
  int64_t exponent = 0;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    bool negative = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
    const size_t start = i;
    for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && i - start < 4; ++i)
      exponent = exponent * 10 + (s[i] - '0');
    if (i == start) return std::nullopt;
    if (negative) exponent = -exponent;
  }
  if (i + 1 == s.size()) {
    const char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(s[i])));
    if (unit == 'K') exponent += 3;
    else if (unit == 'M') exponent += 6;
    else if (unit == 'B' || unit == 'G') exponent += 9;
    else if (unit == 'T') exponent += 12;
    else return std::nullopt;
    ++i;
  }
  if (i != s.size()) return std::nullopt;
  exponent -= frac;
  // digits x 10^exponent, whole and in range.
  while (exponent < 0) {
    if (digits.back() != '0') return std::nullopt;  // a fraction of a parameter
    digits.pop_back();
    ++exponent;
    if (digits.empty()) return std::nullopt;
  }
  const auto first = digits.find_first_not_of('0');
  if (first == std::string::npos) return std::nullopt;  // zero
  digits = digits.substr(first);
  if (static_cast<int64_t>(digits.size()) + exponent > 17) return std::nullopt;  // >= 1e17
  int64_t v = 0;
  for (char c : digits) v = v * 10 + (c - '0');
  for (int64_t k = 0; k < exponent; ++k) v *= 10;
  if (v < 1 || v > kMaxParams) return std::nullopt;
  return v;
}

std::optional<int64_t> parse_bytes(const std::string& s) { return zero::parse_byte_size(s); }

config::Config config_for(const Setup& s, const std::string& precision, int64_t world) {
  nlohmann::json z = {{"stage", s.stage}};
  if (s.mics) z["mics_shard_size"] = s.mics;
  if (s.hpz) z["zero_hpz_partition_size"] = s.hpz;
  if (s.quantized) z["zero_quantized_weights"] = z["zero_quantized_gradients"] = true;
  if (s.offload_optimizer != "none")
    z["offload_optimizer"] = {{"device", s.offload_optimizer}, {"nvme_path", "/nvme"}};
  if (s.offload_param != "none") z["offload_param"] = {{"device", s.offload_param}, {"nvme_path", "/nvme"}};
  nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"optim_bits", s.optim_bits == 8 ? 8 : 32}}}}},
                      {"zero_optimization", z}};
  if (precision == "fp16") j["fp16"] = {{"enabled", true}};
  if (precision == "bf16") j["bf16"] = {{"enabled", true}};
  if (s.optim_bits == 16)
    j["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};
  else if (s.master16 && precision == "bf16")
    j["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}};
  else if (s.master16 && precision == "fp16")
    j["fp16"] = {{"enabled", true}, {"fp16_master_weights_and_grads", true}};
  config::LoadOptions o;
  o.world_size = world;
  return config::load_string(j.dump(), o, "zero estimate (" + s.name + ")");
}

// A weights file's tensors as parameters: a layer per "<prefix>.<number>."
// block (model.layers.3.), and one per other module (the name less its last
// part), as a model of a ModuleList of blocks with its other modules given
// as layers is laid out at stage 3.
std::vector<ParameterShape> weights_parameters(const std::vector<ckpt::WeightTensor>& tensors) {
  std::map<std::string, int> layers;
  std::vector<ParameterShape> out;
  for (const auto& t : tensors) {
    if (!at::isFloatingType(t.dtype)) continue;
    std::string key = t.name.substr(0, t.name.rfind('.') == std::string::npos ? 0 : t.name.rfind('.'));
    for (size_t dot = t.name.find('.'); dot != std::string::npos; dot = t.name.find('.', dot + 1)) {
      size_t end = dot + 1;
      while (end < t.name.size() && std::isdigit(static_cast<unsigned char>(t.name[end]))) ++end;
      if (end > dot + 1 && end < t.name.size() && t.name[end] == '.') {
        key = t.name.substr(0, end);
        break;
      }
    }
    const auto [it, fresh] = layers.emplace(key, static_cast<int>(layers.size()));
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    out.push_back({t.name, numel, it->second});
  }
  return out;
}

nlohmann::json to_json(const StateBytes& b) {
  return {{"parameters", b.parameters},
          {"gradients", b.gradients},
          {"optimizer_states", b.optimizer_states},
          {"frozen_parameters", b.frozen_parameters},
          {"total", b.total()}};
}

}  // namespace

std::optional<std::array<int64_t, 4>> parse_mingpt_model(const std::string& v, std::string& error) {
  std::vector<int64_t> dims;
  error = "--model: expected mingpt:L,C[,V,T]; got \"" + v + "\"";
  if (v.rfind("mingpt:", 0) != 0) return std::nullopt;
  std::stringstream ss(v.substr(7));
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      size_t used = 0;
      const long long x = std::stoll(item, &used);
      if (used != item.size() || x < 1 || x > (int64_t{1} << 24)) throw std::invalid_argument(item);
      dims.push_back(x);
    } catch (const std::exception&) {
      error = "--model: expected positive integers in mingpt:L,C[,V,T]; got \"" + item + "\"";
      return std::nullopt;
    }
  }
  if (dims.size() < 2 || dims.size() > 4) return std::nullopt;
  if (dims.size() < 3) dims.push_back(50257);
  if (dims.size() < 4) dims.push_back(1024);
  error.clear();
  return std::array<int64_t, 4>{dims[0], dims[1], dims[2], dims[3]};
}

int estimate(const std::vector<std::string>& args) {
  std::optional<int64_t> params, trainable_params;
  models::LoraConfig lora;
  bool lora_targets_given = false;
  std::optional<std::vector<int64_t>> model;  // L, C, V, T
  int64_t per_node = 1, nodes = 1;
  std::string precision = "bf16", json_path, config_path, hf_config_path, weights_path, calibrate_path;
  bool micro_batch_given = false;
  bool precision_given = false;
  std::optional<int> stage;
  std::string off_opt = "none", off_param = "none", optim_bits = "32";
  std::optional<int64_t> device_budget, host_budget, nvme_budget;
  int64_t micro_batch = 1;
  std::optional<int64_t> n_head;
  bool checkpointing = false, nccl = true, workload_given = false;
  std::map<std::string, std::string> given;  // option -> its value, each given once
  auto fail = [](const std::string& m) {
    std::cerr << "zero estimate: " << m << "\n(zero estimate --help for the options)\n";
    return 2;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kEstimateUsage;
      return 0;
    }
    if (a == "--checkpointing") {
      if (checkpointing) return fail("--checkpointing given twice: give it once");
      checkpointing = workload_given = true;
      continue;
    }
    const std::vector<std::string> known = {"--params", "--model", "--ranks-per-node", "--nodes", "--precision",
                                            "--stage", "--offload-optimizer", "--offload-param", "--config",
                                            "--device-memory", "--host-memory", "--nvme-bytes", "--json",
                                            "--micro-batch", "--n_head", "--backend", "--checkpointing",
                                            "--hf-config", "--weights", "--calibrate", "--optim-bits",
                                            "--trainable-params", "--lora", "--lora-targets"};
    if (std::find(known.begin(), known.end(), a) == known.end()) {
      const auto near = nearest(a, known);
      return fail(a + ": unknown option" + (near.empty() ? "" : "; did you mean " + near + "?"));
    }
    if (i + 1 >= args.size()) return fail(a + ": expected a value");
    const std::string& v = args[++i];
    if (auto [it, fresh] = given.emplace(a, v); !fresh)
      return fail(a + " given twice (\"" + it->second + "\" and \"" + v + "\"): give it once");
    auto integer = [&](int64_t lo, int64_t hi) -> std::optional<int64_t> {
      try {
        size_t used = 0;
        const long long x = std::stoll(v, &used);
        if (used == v.size() && x >= lo && x <= hi) return x;
      } catch (const std::exception&) {
      }
      return std::nullopt;
    };
    auto device_kind = [&](std::string& out) {
      if (v != "none" && v != "cpu" && v != "nvme") return false;
      out = v;
      return true;
    };
    if (a == "--params") {
      params = parse_count(v);
      if (!params)
        return fail("--params: expected a whole number of parameters in 1..1e16 such as 1.3e9, 1300M or 1.3B; got \"" + v +
                    "\"");
    } else if (a == "--trainable-params") {
      trainable_params = parse_count(v);
      if (!trainable_params)
        return fail("--trainable-params: expected a whole number of parameters such as 4.2e6, 4200K or 4.2M; got \"" +
                    v + "\"");
    } else if (a == "--lora") {
      auto x = integer(1, 1 << 20);
      if (!x) return fail("--lora: expected a LoRA rank, an integer in 1.." + std::to_string(1 << 20) + "; got \"" + v + "\"");
      lora.r = *x;
    } else if (a == "--lora-targets") {
      lora.target_modules.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) lora.target_modules.push_back(item);
      lora_targets_given = true;
    } else if (a == "--model") {
      std::string error;
      auto dims = parse_mingpt_model(v, error);
      if (!dims) return fail(error);
      model = std::vector<int64_t>(dims->begin(), dims->end());
    } else if (a == "--ranks-per-node" || a == "--nodes") {
      auto x = integer(1, kMaxRanks);
      if (!x) return fail(a + ": expected an integer in 1.." + std::to_string(kMaxRanks) + "; got \"" + v + "\"");
      (a == "--nodes" ? nodes : per_node) = *x;
    } else if (a == "--precision") {
      if (v != "fp32" && v != "fp16" && v != "bf16") return fail("--precision: expected fp32, fp16 or bf16; got \"" + v + "\"");
      precision = v;
      precision_given = true;
    } else if (a == "--optim-bits") {
      if (v != "32" && v != "16" && v != "8" && v != "both" && v != "all")
        return fail("--optim-bits: expected 32, 16, 8, both or all; got \"" + v + "\"");
      optim_bits = v;
    } else if (a == "--stage") {
      auto x = integer(0, 3);
      if (!x) return fail("--stage: expected 0, 1, 2 or 3; got \"" + v + "\"");
      stage = static_cast<int>(*x);
    } else if (a == "--offload-optimizer" || a == "--offload-param") {
      if (!device_kind(a == "--offload-param" ? off_param : off_opt))
        return fail(a + ": expected none, cpu or nvme; got \"" + v + "\"");
    } else if (a == "--device-memory" || a == "--host-memory" || a == "--nvme-bytes") {
      auto b = parse_bytes(v);
      if (!b) return fail(a + ": expected a size such as 80GiB, 1.5e9 or 512MiB; got \"" + v + "\"");
      (a == "--device-memory" ? device_budget : a == "--host-memory" ? host_budget : nvme_budget) = *b;
    } else if (a == "--micro-batch" || a == "--n_head") {
      auto x = integer(1, 1 << 24);
      if (!x) return fail(a + ": expected an integer in 1.." + std::to_string(1 << 24) + "; got \"" + v + "\"");
      (a == "--micro-batch" ? micro_batch : n_head.emplace()) = *x;
      if (a == "--micro-batch") micro_batch_given = true;
      else workload_given = true;
    } else if (a == "--backend") {
      if (v != "nccl" && v != "gloo") return fail("--backend: expected nccl or gloo; got \"" + v + "\"");
      nccl = v == "nccl";
    } else if (a == "--config") {
      try {
        config_path = config_file_argument("--config", v);
      } catch (const UsageError& e) {
        return fail(e.what());
      }
    } else if (a == "--hf-config" || a == "--weights" || a == "--calibrate") {
      (a == "--hf-config" ? hf_config_path : a == "--weights" ? weights_path : calibrate_path) = v;
    } else {  // --json: the options were checked against `known` above
      json_path = v;
    }
  }
  const int sources = params.has_value() + model.has_value() + !hf_config_path.empty() + !weights_path.empty();
  if (sources > 1 || (sources == 0 && calibrate_path.empty()))
    return fail("expected one model: --params P, --model mingpt:L,C[,V,T], --hf-config FILE, --weights FILE or "
                "--calibrate REPORT (its parameters)");
  if (trainable_params && !params)
    return fail("--trainable-params goes with --params (with --hf-config, --lora R gives the trainable parameters)");
  if (trainable_params && params && *trainable_params > *params)
    return fail("--trainable-params " + given["--trainable-params"] + ": more than --params " + given["--params"]);
  if ((lora.enabled() || lora_targets_given) && hf_config_path.empty())
    return fail("--lora and --lora-targets go with --hf-config (a Llama's layers are what the adapters attach to)");
  if (lora_targets_given && !lora.enabled()) return fail("--lora-targets goes with --lora R");
  if (workload_given && !model)
    return fail("--n_head and --checkpointing describe a minGPT step: they go with --model");
  if (micro_batch_given && !model && calibrate_path.empty())
    return fail("--micro-batch goes with --model or --calibrate (a step's activations)");
  if (model && !calibrate_path.empty())
    return fail("--model counts minGPT's activations by formula; --calibrate measures them: give one");
  if (model && n_head && (*model)[1] % *n_head != 0)
    return fail("--n_head " + std::to_string(*n_head) + " must divide the width " + std::to_string((*model)[1]));
  if (!stage && (off_opt != "none" || off_param != "none")) return fail("--offload-optimizer and --offload-param go with --stage");
  if (stage && *stage < 3 && off_param != "none") return fail("--offload-param needs --stage 3");
  if (stage && !config_path.empty()) return fail("--stage and --config both choose the configuration: give one");
  if (precision_given && !config_path.empty()) return fail("--precision and --config both set the precision: give one");
  if (optim_bits == "16" && stage && *stage == 0)
    return fail("--optim-bits 16: a bf16 master and states need ZeRO stage 1-3 (DeepSpeed's rule); got --stage 0");
  if (optim_bits == "16" && precision != "bf16")
    return fail("--optim-bits " + optim_bits + ": a bf16 master and states go with --precision bf16");
  if (given.count("--optim-bits") && !config_path.empty())
    return fail("--optim-bits and --config both set the optimizer states (optimizer.params.optim_bits): give one");
  if (model) {
    const double L = static_cast<double>((*model)[0]), C = static_cast<double>((*model)[1]);
    if (L > 100000 || 12.0 * L * C * C + 2.0 * C * static_cast<double>((*model)[2]) > 1e16)
      return fail("--model: at most 100000 blocks and 1e16 parameters");
  }
  if (per_node * nodes > kMaxRanks)
    return fail("--ranks-per-node " + std::to_string(per_node) + " x --nodes " + std::to_string(nodes) + " is " +
                std::to_string(per_node * nodes) + " ranks; at most " + std::to_string(kMaxRanks) +
                " (the per-rank figures stay exact up to there)");
  const int64_t world = per_node * nodes;
  // The output is checked before the work, not found unwritable after it,
  // and is none of the files the estimate reads (NOTE [outputs and inputs]).
  if (!json_path.empty()) {
    CommandFiles files;
    if (!config_path.empty()) files.reads("--config", config_path);
    if (!hf_config_path.empty()) files.reads("--hf-config", hf_config_path);
    if (!calibrate_path.empty()) files.reads("--calibrate", calibrate_path);
    if (!weights_path.empty()) {
      try {
        const auto w = ckpt::WeightFiles::resolve(weights_path);
        if (!w.index.empty()) files.reads("--weights' index", w.index);
        for (const auto& f : w.files) files.reads("--weights", f);
      } catch (const IoError&) {  // the estimate names what is wrong with them
        files.reads("--weights", weights_path);
      }
    }
    files.writes("--json", json_path);
    if (const std::string problem = files.problem(); !problem.empty()) return fail(problem);
    if (const std::string problem = ckpt::output_file_problem("--json", json_path); !problem.empty()) return fail(problem);
  }

  try {
    // The configurations, as DeepSpeed's estimator tables them, or the one asked for.
    std::vector<std::pair<Setup, config::Config>> setups;
    if (!config_path.empty()) {
      config::LoadOptions o;
      o.world_size = world;
      o.auto_stand_ins = true;
      auto c = config::load_file(config_path, o);
      setups.push_back({Setup{config_path, c.zero.stage, config::to_string(c.zero.offload_optimizer.device),
                              config::to_string(c.zero.offload_param.device),
                              c.optimizer && c.optimizer->bf16_states ? 16 : c.optimizer ? c.optimizer->optim_bits : 32,
                              c.zero.stage > 0 && ((c.bf16.enabled && c.bf16.bf16_master_weights_and_grads) ||
                                                   (c.fp16.enabled && c.fp16.fp16_master_weights_and_grads))},
                        c});
    } else {
      std::vector<Setup> list;
      if (stage) {
        std::string name = "stage " + std::to_string(*stage);
        if (off_opt != "none") name += " + offload_optimizer " + off_opt;
        if (off_param != "none") name += " + offload_param " + off_param;
        list.push_back({name, *stage, off_opt, off_param});
      } else {
        list = {{"stage 0", 0},
                {"stage 1", 1},
                {"stage 2", 2},
                {"stage 2 + offload_optimizer cpu", 2, "cpu"},
                {"stage 2 + offload_optimizer nvme", 2, "nvme"},
                {"stage 3", 3},
                {"stage 3 + offload_optimizer cpu", 3, "cpu"},
                {"stage 3 + offload_optimizer cpu + offload_param cpu", 3, "cpu", "cpu"},
                {"stage 3 + offload_optimizer nvme + offload_param nvme", 3, "nvme", "nvme"}};
      }
      // Moments' bits, and a 16-bit master: 32, 16 (bf16 master and states),
      // 8, and 8 under a 16-bit master (--optim-bits all).
      const std::pair<int, bool> kinds[] = {{32, false}, {16, true}, {8, false}, {8, true}};
      for (const auto& s : list) {
        for (const auto& [bits, master16] : kinds) {
          const bool wanted = optim_bits == "all" || (!master16 && optim_bits == std::to_string(bits)) ||
                              (bits == 16 && optim_bits == "16") || (optim_bits == "both" && !master16);
          if (!wanted) continue;
          if (master16 && s.stage == 0) continue;  // DeepSpeed's rule: stages 1-3
          if (master16 && precision == "fp32") continue;
          if (bits == 16 && precision != "bf16") continue;  // bf16_optimizer_states is bf16's
          Setup b = s;
          b.optim_bits = bits;
          b.master16 = master16;
          if (bits == 8) b.name += master16 ? " + " + precision + " master and 8-bit states" : " + 8-bit states";
          if (bits == 16) b.name += " + bf16 master and states";
          setups.push_back({b, config_for(b, precision, world)});
          // More than one node of several ranks: each configuration at
          // stages 2-3 with the model states sharded within a node (MiCS,
          // replicated across the nodes), and at stage 3 with hpZ's
          // secondary partition in the node, alone and with ZeRO++'s
          // quantized collectives (whose buffers are in the peak).
          if (nodes > 1 && per_node > 1 && b.stage >= 2) {
            const std::string g = std::to_string(per_node);
            std::vector<Setup> keyed{b};
            keyed[0].mics = per_node, keyed[0].name += " + mics_shard_size " + g;
            if (b.stage == 3) {
              keyed.push_back(b), keyed[1].hpz = per_node, keyed[1].name += " + zero_hpz_partition_size " + g;
              keyed.push_back(keyed[1]), keyed[2].quantized = true, keyed[2].name += ", qwZ, qgZ";
            }
            for (const Setup& k : keyed) setups.push_back({k, config_for(k, precision, world)});
          }
        }
      }
    }

    // The model: by size, minGPT's shape, a Llama config.json, a weights
    // file's tensors, or a run report's parameters.
    std::optional<models::LlamaConfig> llama;
    std::optional<RunReport> report;
    std::vector<ParameterShape> fixed;  // --weights, or the report's
    std::string what = "a model";
    if (!hf_config_path.empty()) {
      llama = models::LlamaConfig::from_file(hf_config_path);
      what = "Llama (" + hf_config_path + ")";
      if (lora.enabled()) {
        lora.check(*llama, "--lora", '-');
        std::string targets;
        for (const auto& t : lora.target_modules) targets += (targets.empty() ? "" : ",") + t;
        what += " with LoRA r=" + std::to_string(lora.r) + " on " + targets;
      }
    }
    if (!calibrate_path.empty()) report = read_run_report(calibrate_path);
    if (!weights_path.empty()) {
      std::vector<ckpt::WeightTensor> tensors;
      ckpt::SavedLayout layout;
      ckpt::PieceReader::weights(ckpt::WeightFiles::resolve(weights_path), nullptr, &layout, &tensors, {});
      fixed = weights_parameters(tensors);
      if (fixed.empty()) throw IoError(weights_path + ": no floating-point tensor (no parameter to count)");
      what = weights_path + " (" + std::to_string(fixed.size()) + " tensors)";
    } else if (report && sources == 0) {
      fixed = report->parameters();
      if (fixed.empty()) throw IoError(calibrate_path + ": the run report lists no parameters");
      what = "the model of " + calibrate_path;
    }
    if (model)
      what = "minGPT L=" + std::to_string((*model)[0]) + " C=" + std::to_string((*model)[1]) +
             " V=" + std::to_string((*model)[2]) + " T=" + std::to_string((*model)[3]);
    const bool scalable = fixed.empty();  // budgets give the largest model of this kind
    auto shapes_for = [&](int64_t n) {
      if (model) return mingpt_parameters(n, (*model)[1], (*model)[2], (*model)[3]);
      if (llama) {
        auto c = *llama;
        c.num_hidden_layers = n;
        return models::llama_parameters(c, lora);
      }
      if (!fixed.empty()) return fixed;
      if (trainable_params && params) {  // the fraction held as the model scales
        const int64_t t = static_cast<int64_t>(std::llround(static_cast<double>(n) *
                                                            static_cast<double>(*trainable_params) /
                                                            static_cast<double>(*params)));
        std::vector<ParameterShape> split;
        if (n - t > 0) split.push_back({"frozen", n - t, 0, true});
        if (t > 0) split.push_back({"trainable", t, 0, false});
        return split;
      }
      return parameters_of_size(n);
    };
    const int64_t size = model ? (*model)[0] : llama ? llama->num_hidden_layers : params ? *params : 1;

    // --calibrate: the activations of a sample, from the report's measured
    // device peak less what its own config's states and buffers take.
    std::optional<double> activation_per_sample;
    int64_t step_micro_batch = micro_batch;
    nlohmann::json calibration;
    if (report) {
      if ((report->outcome != "completed" && report->outcome != "stopped") || report->steps < 1)
        throw UsageError("--calibrate " + calibrate_path + ": a run that trained no step (outcome " + report->outcome +
                         ", " + std::to_string(report->steps) + " steps) measured no activations");
      const auto& rc = report->json.at("config");
      Setup rs{"the report's config", rc.at("stage").get<int>(), rc.at("offload_optimizer").get<std::string>(),
               rc.at("offload_param").get<std::string>()};
      // The run's own config, buckets and thresholds included.
      config::LoadOptions ro;
      ro.world_size = report->world_size;
      ro.auto_stand_ins = true;
      const auto rcfg = rc.contains("resolved")
                            ? config::load_string(rc.at("resolved").dump(), ro, calibrate_path + " (its config)")
                            : config_for(rs, rc.at("precision").get<std::string>(), report->world_size);
      const int64_t rmb = std::max<int64_t>(1, rc.at("train_micro_batch_size_per_gpu").get<int64_t>());
      const bool rnccl = report->json.value("device", "cpu").rfind("cuda", 0) == 0 && report->world_size > 1;
      const auto shapes = shapes_for(size);
      int64_t numel = 0;
      for (const auto& p : shapes) numel += p.frozen ? 0 : p.numel;  // the report counts the trainable ones
      const int64_t reported = report->json.value("num_parameters", int64_t{0});
      if (reported != numel)
        std::fprintf(stderr, "zero estimate: warning: %s is a run of a model of %lld parameters, this one has %lld\n",
                     calibrate_path.c_str(), static_cast<long long>(reported), static_cast<long long>(numel));
      const auto base = estimate_peak(rcfg, shapes, Activations{}, rnccl);
      const int64_t measured = report->peak("device");
      activation_per_sample = static_cast<double>(std::max<int64_t>(0, measured - base.device())) / static_cast<double>(rmb);
      if (!micro_batch_given) step_micro_batch = rmb;
      calibration = {{"report", calibrate_path}, {"measured_device_peak", measured}, {"micro_batch", rmb},
                     {"states_and_buffers", base.device()}, {"activations_per_sample", *activation_per_sample}};
      std::printf("calibration: %s measured a device peak of %s at stage %d, micro-batch %lld; its states and buffers "
                  "estimate %s: %s of activations per sample\n",
                  calibrate_path.c_str(), format_bytes(measured).c_str(), rs.stage, static_cast<long long>(rmb),
                  format_bytes(base.device()).c_str(),
                  format_bytes(static_cast<int64_t>(*activation_per_sample)).c_str());
    }
    const bool peaks = model || activation_per_sample.has_value();
    const bool budgets = device_budget || host_budget || nvme_budget;
    auto workload = [&](int64_t n_layer) {
      MinGPTWorkload w;
      w.n_layer = n_layer;
      w.n_embd = (*model)[1];
      w.vocab_size = (*model)[2];
      w.block_size = (*model)[3];
      w.n_head = n_head.value_or(std::max<int64_t>(1, w.n_embd / 64));
      w.micro_batch = micro_batch;
      w.checkpointing = checkpointing;
      return w;
    };
    // Per rank: with --model the peak of a step, with --params the model states.
    struct Need {
      int64_t device, host, nvme;
    };
    auto peak_of = [&](const config::Config& cfg, int64_t n) {
      if (model) return estimate_peak(cfg, workload(n), nccl);
      Activations a;
      a.device = static_cast<int64_t>(*activation_per_sample * static_cast<double>(step_micro_batch));
      return estimate_peak(cfg, shapes_for(n), a, nccl);
    };
    auto need = [&](const config::Config& cfg, int64_t n) {
      if (peaks) {
        const auto pk = peak_of(cfg, n);
        return Need{pk.device(), pk.host(), pk.nvme()};
      }
      const auto e = estimate_model_states(cfg, shapes_for(n));
      return Need{e.device.total(), e.host.total(), e.nvme.total()};
    };
    auto fits_need = [&](const Need& e) {
      return (!device_budget || e.device <= *device_budget) && (!host_budget || e.host <= *host_budget) &&
             (!nvme_budget || e.nvme <= *nvme_budget);
    };

    const auto first = estimate_model_states(setups.front().second, shapes_for(size));
    std::printf("zero estimate: %s, %lld parameters, %lld rank(s) (%lld per node x %lld node(s)), %s\n", what.c_str(),
                static_cast<long long>(first.num_parameters), static_cast<long long>(world),
                static_cast<long long>(per_node), static_cast<long long>(nodes),
                config_path.empty() ? precision.c_str() : "as the config says");
    int64_t frozen_numel = 0;
    for (const auto& q : shapes_for(size)) frozen_numel += q.frozen ? q.numel : 0;
    if (frozen_numel > 0)
      std::printf("%lld of them frozen (no gradient, master or optimizer state; partitioned at stage 3), %lld "
                  "trainable\n",
                  static_cast<long long>(frozen_numel), static_cast<long long>(first.num_parameters - frozen_numel));
    std::printf(frozen_numel > 0
                    ? "memory per rank (parameters + gradients + optimizer states + frozen parameters):\n"
                    : "model states per rank (parameters + gradients + optimizer states):\n");
    int name_width = 68;  // the longest configuration's name, at least
    for (const auto& [setup, cfg] : setups) name_width = std::max(name_width, static_cast<int>(setup.name.size()));
    std::printf("  %-*s %-50s %-50s %-10s%s\n", name_width, "", "device", "host", "nvme",
                budgets ? "   fits   largest that fits" : "");
    nlohmann::json out = {{"ranks", world}, {"num_parameters", first.num_parameters}, {"model", what},
                          {"frozen_parameters", frozen_numel},
                          {"configurations", nlohmann::json::array()}};
    if (!calibration.is_null()) out["calibration"] = calibration;
    for (const auto& [setup, cfg] : setups) {
      const auto e = estimate_model_states(cfg, shapes_for(size));
      auto cell = [&](const StateBytes& b) {
        if (b.total() == 0) return std::string("0");
        return format_bytes(b.total()) + " (" + format_bytes(b.parameters) + " + " + format_bytes(b.gradients) + " + " +
               format_bytes(b.optimizer_states) + (frozen_numel > 0 ? " + " + format_bytes(b.frozen_parameters) : "") +
               ")";
      };
      nlohmann::json row = {{"name", setup.name},
                            {"stage", setup.stage},
                            {"offload_optimizer", setup.offload_optimizer},
                            {"offload_param", setup.offload_param},
                            {"optim_bits", setup.optim_bits},
                            {"mics_shard_size", std::max<int64_t>(0, cfg.zero.mics_shard_size)},
                            {"zero_hpz_partition_size",
                             cfg.zero.zero_hpz_partition_size > 1 ? cfg.zero.zero_hpz_partition_size : int64_t{0}},
                            {"zero_quantized_weights", cfg.zero.zero_quantized_weights},
                            {"zero_quantized_gradients", cfg.zero.zero_quantized_gradients},
                            {"master", setup.master16 ? std::string(cfg.fp16.enabled ? "fp16" : "bf16") : std::string("fp32")},
                            {"device", to_json(e.device)},
                            {"host", to_json(e.host)},
                            {"nvme", to_json(e.nvme)}};
      std::string extra, placement_line;
      if (budgets && !scalable) {
        const bool fit = fits_need(need(cfg, size));
        row["fits"] = fit;
        extra = std::string("   ") + (fit ? "yes " : "no  ") + "   (a fixed model)";
      } else if (budgets) {
        // Up to 100000 blocks (at most 1e16 parameters) or 1e16 parameters.
        const int64_t limit =
            model   ? std::max<int64_t>(1, std::min<int64_t>(100000, static_cast<int64_t>(
                                                                         1e16 / (12.0 * (*model)[1] * (*model)[1] + 1))))
            : llama ? 100000
                    : static_cast<int64_t>(1e16);
        // The largest size that fits under the config `at(n)` gives for
        // size n: states grow with the size, so double, then bisect.
        auto largest_size_at = [&](const auto& at) {
          int64_t lo = 0, hi = 1;
          auto ok = [&](int64_t n) { return fits_need(need(at(n), n)); };
          while (hi < limit && ok(hi)) lo = hi, hi *= 2;
          if (hi >= limit && ok(limit)) lo = limit;
          else
            while (hi - lo > 1) {
              const int64_t mid = lo + (hi - lo) / 2;
              (ok(mid) ? lo : hi) = mid;
            }
          return lo;
        };
        auto largest_size = [&](const config::Config& c) {
          return largest_size_at([&](int64_t) -> const config::Config& { return c; });
        };
        const int64_t lo = largest_size(cfg);
        const int64_t largest_params = lo == 0 ? 0 : estimate_model_states(cfg, shapes_for(lo)).num_parameters;
        // NOTE [memory estimate] (the planner): where the optimizer is
        // offloaded at stages 2-3, the placement that fits the largest model:
        // the gradient partition on the host or the device (NOTE [device
        // gradients]), at stage 3 with the shards on the device the share of
        // the states offloaded (NOTE [partial offload]), over a grid, and
        // with nvme as much of the rest in host memory as the host budget
        // holds (offload_optimizer.max_in_cpu, NOTE [state placement]).
        const auto& oz = cfg.zero.offload_optimizer;
        if (cfg.zero.stage >= 2 && oz.device != config::OffloadDevice::kNone && lo < limit) {
          const bool ratios = cfg.zero.stage == 3 && cfg.zero.offload_param.device == config::OffloadDevice::kNone;
          const bool speculates = oz.super_offload && ratios && oz.device == config::OffloadDevice::kCpu;
          const bool fills = oz.device == config::OffloadDevice::kNvme && host_budget.has_value();
          // With nvme, `c` at size n with max_in_cpu as large as the host
          // budget allows (fill_host_budget, tune_plan.h). The host then
          // holds the engine's pinned staging too, which exists whatever the
          // model states' accounting (their sum is the peak with no
          // activations where the activations are not known).
          auto filled = [&](config::Config c, int64_t n) {
            if (!fills) return c;
            c.zero.offload_optimizer.max_in_cpu =
                fill_host_budget(c, shapes_for(n), *host_budget, [&](const config::Config& f) {
                  return peaks ? need(f, n).host : estimate_peak(f, shapes_for(n), Activations{}, nccl).host();
                });
            return c;
          };
          // (From the config's own placement outward; another is taken only
          // for a model at least 1% larger: a group of a few hundred
          // elements moved is no placement to propose; with nvme the host's
          // fill is proposed at the config's own size too: it reads less.)
          int64_t best = lo;
          std::optional<std::pair<double, bool>> chosen;
          if (fills) chosen = std::make_pair(oz.ratio, oz.gradients_on_device);
          std::vector<double> grid{oz.ratio};
          if (ratios)
            for (int k = 20; k >= 0; --k) grid.push_back(k / 20.0);  // 1, 0.95, ..., 0
          for (const double r : grid) {
            for (const bool on_device : {false, true}) {
              if (on_device && speculates) continue;  // super_offload reads host gradients
              config::Config c = cfg;
              c.zero.offload_optimizer.ratio = r;
              c.zero.offload_optimizer.gradients_on_device = on_device;
              const int64_t n = largest_size_at([&](int64_t size) { return filled(c, size); });
              if (static_cast<double>(n) > 1.01 * static_cast<double>(best)) best = n, chosen = std::make_pair(r, on_device);
            }
          }
          config::Config c = cfg;
          if (chosen) {
            c.zero.offload_optimizer.ratio = chosen->first;
            c.zero.offload_optimizer.gradients_on_device = chosen->second;
            c = filled(c, best);
          }
          if (chosen && (best > lo || c.zero.offload_optimizer.max_in_cpu > oz.max_in_cpu)) {
            const int64_t params = estimate_model_states(c, shapes_for(best)).num_parameters;
            row["placement"] = {{"ratio", chosen->first},
                                {"gradients_on_device", chosen->second},
                                {"largest", model   ? nlohmann::json{{"n_layer", best}, {"num_parameters", params}}
                                            : llama ? nlohmann::json{{"num_hidden_layers", best}, {"num_parameters", params}}
                                                    : nlohmann::json{{"num_parameters", params}}}};
            if (fills) row["placement"]["max_in_cpu"] = c.zero.offload_optimizer.max_in_cpu;
            char line[320];
            std::snprintf(line, sizeof line, "offload_optimizer.ratio %g, gradients on the %s%s: %.3g params, %.2fx",
                          chosen->first, chosen->second ? "device" : "host",
                          fills ? (", max_in_cpu " + std::to_string(c.zero.offload_optimizer.max_in_cpu)).c_str() : "",
                          static_cast<double>(params),
                          largest_params > 0 ? static_cast<double>(params) / static_cast<double>(largest_params) : 0.0);
            placement_line = line;
          }
        }
        const bool fit = fits_need(need(cfg, size));
        row["fits"] = fit;
        row["largest"] = model   ? nlohmann::json{{"n_layer", lo}, {"num_parameters", largest_params}}
                         : llama ? nlohmann::json{{"num_hidden_layers", lo}, {"num_parameters", largest_params}}
                                 : nlohmann::json{{"num_parameters", largest_params}};
        char buf[96];
        const bool unbounded = lo >= limit;  // no budget given binds this configuration
        row["largest"]["unbounded"] = unbounded;
        if (unbounded) std::snprintf(buf, sizeof buf, "   %-4s   unbounded by these budgets", fit ? "yes" : "no");
        else if (model || llama)
          std::snprintf(buf, sizeof buf, "   %-4s   %s=%lld (%.3g params)", fit ? "yes" : "no",
                        model ? "L" : "num_hidden_layers", static_cast<long long>(lo), static_cast<double>(largest_params));
        else std::snprintf(buf, sizeof buf, "   %-4s   %.3g params", fit ? "yes" : "no", static_cast<double>(largest_params));
        extra = buf;
      }
      std::printf("  %-*s %-50s %-50s %-10s%s\n", name_width, setup.name.c_str(), cell(e.device).c_str(), cell(e.host).c_str(),
                  e.nvme.total() == 0 ? "0" : format_bytes(e.nvme.total()).c_str(), extra.c_str());
      if (!placement_line.empty())
        std::printf("  %-*s larger with a placement: %s\n", name_width, "", placement_line.c_str());
      if (peaks) {
        const auto pk = peak_of(cfg, size);
        std::printf("  %-*s device %s (+%s activations +%s buffers), host %s (+%s +%s), nvme %s\n", name_width,
                    "  peak of a step:", format_bytes(pk.device()).c_str(), format_bytes(pk.activations).c_str(),
                    format_bytes(pk.device_buffers).c_str(), format_bytes(pk.host()).c_str(),
                    format_bytes(pk.host_activations).c_str(), format_bytes(pk.host_buffers).c_str(),
                    format_bytes(pk.nvme()).c_str());
        row["peak"] = {{"device", pk.device()},          {"host", pk.host()},
                       {"nvme", pk.nvme()},              {"activations", pk.activations},
                       {"host_activations", pk.host_activations}, {"device_buffers", pk.device_buffers},
                       {"host_buffers", pk.host_buffers}};
      }
      out["configurations"].push_back(row);
    }
    if (budgets)
      std::printf(peaks ? "budgets per rank: device %s, host %s, nvme %s (the peak of a step)\n"
                        : "budgets per rank: device %s, host %s, nvme %s (model states only)\n",
                  device_budget ? format_bytes(*device_budget).c_str() : "-",
                  host_budget ? format_bytes(*host_budget).c_str() : "-",
                  nvme_budget ? format_bytes(*nvme_budget).c_str() : "-");
    if (!json_path.empty()) ckpt::write_file_atomically(json_path, out.dump(2) + "\n");
    return 0;
  } catch (const Error& e) {
    std::cerr << "zero estimate: " << error_text(e) << "\n";
    return 1;
  } catch (const nlohmann::json::exception& e) {
    std::cerr << "zero estimate: " << calibrate_path << ": a damaged run report: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace zero::tools
