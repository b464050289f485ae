// optimizer and scheduler: {"type": ..., "params": {...}}, where params are
// constructor kwargs in DeepSpeed, so an unknown or "auto" param is an error.
// Rules: ../shared/ds_config_rules.md 6.5 and 8.2.
#include <algorithm>
#include <cctype>

#include "sections.h"

namespace zero::config::detail {
namespace {

constexpr const char* kImplementedOptimizers = "Adam, AdamW, Adagrad, Lion";
constexpr const char* kImplementedSchedulers = "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

template <typename T>
AutoFill fill_from(const std::optional<T>& value, const char* needs) {
  return AutoFill{value ? std::optional<Json>(Json(*value)) : std::nullopt, needs};
}

// betas: a list of two numbers in [0, 1).
void read_betas(Section& p, std::array<double, 2>& betas, const AutoFill& fill) {
  p.read_value(
      "betas", "a list of two numbers in [0, 1)", fill, /*record=*/true,
      [&](const Json& v) {
        if (!v.is_array() || v.size() != 2) return false;
        std::array<double, 2> b{};
        for (size_t i = 0; i < 2; ++i) {
          if (!to_double(v[i], false, b[i]) || b[i] < 0.0 || b[i] >= 1.0) return false;
        }
        betas = b;
        return true;
      },
      [&] { return Json::array({betas[0], betas[1]}); });
}

// DeepSpeed's scheduler kwarg last_batch_iteration (-1: start from scratch).
void read_last_batch_iteration(Section& p) {
  int64_t last = -1;
  if (p.read_int("last_batch_iteration", last, std::nullopt, {}, /*record=*/false) == Got::kGiven && last != -1) {
    p.context().problem(p.path_of("last_batch_iteration"),
                        "resuming a schedule this way is not implemented by zero (it restores the scheduler from "
                        "its checkpoint); expected -1; got " + std::to_string(last));
  }
}

void require(Section& p, const char* key, const std::string& type) {
  if (!p.has(key)) {
    p.context().problem(p.path_of(key), std::string("expected a value (a required parameter of ") + type + "); got nothing");
  }
}

void read_warmup_type(Section& p, WarmupType& out) {
  std::string type = "log";
  const Json* v = p.raw("warmup_type");
  if (v == nullptr || v->is_null()) {
    p.context().record(p.record_path_of("warmup_type"), "log", Origin::kDefault);
    out = WarmupType::kLog;
    return;
  }
  if (p.read_string("warmup_type", type, /*record=*/false) != Got::kGiven) return;
  if (type == "linear") {
    out = WarmupType::kLinear;
  } else {
    out = WarmupType::kLog;
    if (type != "log") {
      p.context().warn(p.path_of("warmup_type"), "expected log or linear; got " + show(*v) +
                                                     ", so log is used as DeepSpeed does");
    }
  }
  p.context().record(p.record_path_of("warmup_type"), out == WarmupType::kLinear ? "linear" : "log", Origin::kGiven);
}

// warmup_min_lr / warmup_max_lr / warmup_num_steps / warmup_type of WarmupLR
// and WarmupDecayLR.
void read_warmup_lr(Section& p, SchedulerConfig& s, const AutoValues& av) {
  Context& ctx = p.context();
  // The Hugging Face integration fills warmup_min_lr with 0 and
  // warmup_max_lr with the learning rate.
  p.read_double("warmup_min_lr", s.warmup_min_lr, Range::at_least(0), AutoFill{Json(0.0), "lr"});
  double max_lr = 0;
  const Got got = p.read_double("warmup_max_lr", max_lr, Range::at_least(0), fill_from(av.lr, "lr"), /*record=*/false);
  if (got == Got::kGiven || got == Got::kFilled) {
    s.warmup_max_lr = max_lr;
    ctx.record(p.record_path_of("warmup_max_lr"), max_lr, got == Got::kGiven          ? Origin::kGiven
                                                          : ctx.is_stand_in("lr") ? Origin::kAuto
                                                                                  : Origin::kDerived);
  } else if (got != Got::kBad) {
    ctx.record(p.record_path_of("warmup_max_lr"), nullptr, Origin::kDefault);
  }
  p.read_int("warmup_num_steps", s.warmup_num_steps, Range::above(0), fill_from(av.warmup_num_steps, "warmup_num_steps"));
  read_warmup_type(p, s.warmup_type);
}

SchedulerConfig read_scheduler_params(Section& p, SchedulerConfig s, const AutoValues& av) {
  Context& ctx = p.context();
  const AutoFill total_fill = fill_from(av.total_num_steps, "total_num_steps");
  switch (s.type) {
    case SchedulerType::kWarmupLR:
      read_warmup_lr(p, s, av);
      break;
    case SchedulerType::kWarmupDecayLR:
      read_warmup_lr(p, s, av);
      require(p, "total_num_steps", s.type_name);
      p.read_int("total_num_steps", s.total_num_steps, Range::above(0), total_fill);
      break;
    case SchedulerType::kWarmupCosineLR:
      for (const char* key : {"warmup_min_lr", "warmup_max_lr"}) {
        if (p.raw(key) != nullptr) {
          ctx.problem(p.path_of(key), "not a parameter of WarmupCosineLR (DeepSpeed raises TypeError); expected "
                                      "warmup_min_ratio and cos_min_ratio, which are ratios of the optimizer's lr");
        }
      }
      require(p, "total_num_steps", s.type_name);
      p.read_int("total_num_steps", s.total_num_steps, Range::above(0), total_fill);
      p.read_double("warmup_min_ratio", s.warmup_min_ratio, Range::at_least(0));
      p.read_int("warmup_num_steps", s.warmup_num_steps, Range::above(0),
                 fill_from(av.warmup_num_steps, "warmup_num_steps"));
      p.read_double("cos_min_ratio", s.cos_min_ratio, Range::at_least(0));
      read_warmup_type(p, s.warmup_type);
      break;
    case SchedulerType::kOneCycle: {
      require(p, "cycle_min_lr", s.type_name);
      require(p, "cycle_max_lr", s.type_name);
      p.read_double("cycle_min_lr", s.cycle_min_lr, Range::at_least(0));
      p.read_double("cycle_max_lr", s.cycle_max_lr, Range::at_least(0));
      p.read_double("decay_lr_rate", s.decay_lr_rate, Range{});
      p.read_int("cycle_first_step_size", s.cycle_first_step_size, Range::above(0));
      int64_t second = 0;
      const Got got = p.read_int("cycle_second_step_size", second, Range::at_least(0), {}, /*record=*/false);
      if (got == Got::kGiven) {
        s.cycle_second_step_size = second;
        ctx.record(p.record_path_of("cycle_second_step_size"), second, Origin::kGiven);
      } else if (got != Got::kBad) {
        ctx.record(p.record_path_of("cycle_second_step_size"), nullptr, Origin::kDefault);
      }
      p.read_int("cycle_first_stair_count", s.cycle_first_stair_count, Range::at_least(0));
      // Absent: DeepSpeed uses cycle_first_stair_count.
      int64_t second_stairs = 0;
      const Got got_stairs = p.read_int("cycle_second_stair_count", second_stairs, Range::at_least(0), {},
                                        /*record=*/false);
      if (got_stairs == Got::kGiven) {
        s.cycle_second_stair_count = second_stairs;
        ctx.record(p.record_path_of("cycle_second_stair_count"), second_stairs, Origin::kGiven);
      } else if (got_stairs != Got::kBad) {
        ctx.record(p.record_path_of("cycle_second_stair_count"), s.cycle_first_stair_count, Origin::kDerived);
      }
      p.read_int("decay_step_size", s.decay_step_size, Range::at_least(0));
      p.read_bool("cycle_momentum", s.cycle_momentum);
      p.read_double("cycle_min_mom", s.cycle_min_mom, Range::at_least(0));
      p.read_double("cycle_max_mom", s.cycle_max_mom, Range::at_least(0));
      p.read_double("decay_mom_rate", s.decay_mom_rate, Range{});
      break;
    }
    case SchedulerType::kLRRangeTest:
      p.read_double("lr_range_test_min_lr", s.lr_range_test_min_lr, Range::at_least(0));
      p.read_int("lr_range_test_step_size", s.lr_range_test_step_size, Range::above(0));
      p.read_double("lr_range_test_step_rate", s.lr_range_test_step_rate, Range::at_least(0));
      p.read_bool("lr_range_test_staircase", s.lr_range_test_staircase);
      break;
  }
  read_last_batch_iteration(p);
  return s;
}

}  // namespace

void read_optimizer(Section& top, Config& config) {
  Context& ctx = top.context();
  const Json* raw = top.raw("optimizer");
  if (raw == nullptr || raw->is_null()) {
    ctx.record("optimizer", nullptr, Origin::kDefault);
    return;
  }
  Section o = top.child("optimizer", Kind::kPlain);
  if (!o.present()) return;
  o.known({"legacy_fusion"});
  const Json* type = o.raw("type");
  if (type == nullptr || !type->is_string()) {
    ctx.problem("optimizer.type", std::string("expected one of ") + kImplementedOptimizers + "; got " +
                                      (type == nullptr ? "nothing" : show(*type)));
    return;
  }
  const std::string name = type->get<std::string>();
  OptimizerConfig oc;
  oc.type_name = name;
  const std::string key = lower(name);
  if (key == "adam") {
    oc.type = OptimizerType::kAdam;
  } else if (key == "adamw") {
    oc.type = OptimizerType::kAdamW;
  } else if (key == "adagrad") {
    oc.type = OptimizerType::kAdagrad;
    oc.lr = 1e-2;  // DeepSpeedCPUAdagrad's defaults
    oc.eps = 1e-10;
  } else if (key == "lion") {
    oc.type = OptimizerType::kLion;
    oc.betas = {0.9, 0.99};  // FusedLion / DeepSpeedCPULion default
  } else {
    ctx.problem("optimizer.type", show(*type) + " is not implemented by zero; implemented: " + kImplementedOptimizers);
    return;
  }
  static const char* const kCanonical[] = {"Adam", "AdamW", "Adagrad", "Lion"};
  ctx.record("optimizer.type", kCanonical[static_cast<int>(oc.type)], Origin::kGiven);

  const AutoValues& av = ctx.auto_values();
  const bool adam = oc.type == OptimizerType::kAdam || oc.type == OptimizerType::kAdamW;
  Section p = o.child("params", Kind::kKwargs);
  std::vector<std::string> accepted = {"lr", "weight_decay"};
  p.read_double("lr", oc.lr, Range::at_least(0), fill_from(av.lr, "lr"));
  if (oc.type != OptimizerType::kAdagrad) {
    read_betas(p, oc.betas, fill_from(av.betas, "betas"));
    accepted.push_back("betas");
  }
  if (oc.type != OptimizerType::kLion) {
    p.read_double("eps", oc.eps, Range::at_least(0), fill_from(av.eps, "eps"));
    accepted.push_back("eps");
  }
  p.read_double("weight_decay", oc.weight_decay, Range::at_least(0), fill_from(av.weight_decay, "weight_decay"));
  if (adam) {
    const Got mode = p.read_bool("adam_w_mode", oc.adam_w_mode, {}, /*record=*/false);
    if (oc.type == OptimizerType::kAdamW && mode == Got::kGiven && !oc.adam_w_mode) {
      ctx.warn("optimizer.params.adam_w_mode", "false is ignored for AdamW, which always decouples weight decay "
                                               "(as in DeepSpeed)");
    }
    if (oc.type == OptimizerType::kAdamW) oc.adam_w_mode = true;
    ctx.record("optimizer.params.adam_w_mode", oc.adam_w_mode,
               mode == Got::kGiven && oc.type == OptimizerType::kAdam ? Origin::kGiven : Origin::kDefault);
    p.read_bool("bias_correction", oc.bias_correction);
    if (p.read_bool("amsgrad", oc.amsgrad) == Got::kGiven && oc.amsgrad) {
      ctx.problem("optimizer.params.amsgrad", "true is not implemented by zero; expected false; got true");
    }
    if (const Json* v = p.raw("torch_adam"); v != nullptr) {
      bool unused = false;
      if (p.read_bool("torch_adam", unused, {}, /*record=*/false) == Got::kGiven) {
        ctx.warn("optimizer.params.torch_adam", "ignored: zero always uses its own Adam kernels");
      }
    }
    // bitsandbytes' name for the bits of each moment (NOTE [8-bit states] in optim/).
    int64_t bits = oc.optim_bits;
    if (p.read_int("optim_bits", bits) == Got::kGiven && bits != 8 && bits != 32) {
      ctx.problem("optimizer.params.optim_bits",
                  "expected 32 (fp32 moments) or 8 (block-wise 8-bit moments); got " + std::to_string(bits));
    } else {
      oc.optim_bits = static_cast<int>(bits);
    }
    // bitsandbytes' name too: smaller tensors keep fp32 moments.
    if (p.read_int("min_8bit_size", oc.min_8bit_size, Range::at_least(0)) == Got::kGiven && oc.optim_bits != 8)
      ctx.warn("optimizer.params.min_8bit_size", "ignored: it chooses which blocks of 8-bit moments stay fp32, and "
                                                 "optim_bits is " + std::to_string(oc.optim_bits) + " (fp32 moments)");
    accepted.insert(accepted.end(),
                    {"adam_w_mode", "bias_correction", "amsgrad", "torch_adam", "optim_bits", "min_8bit_size"});
  }
  if (oc.type == OptimizerType::kAdagrad) {
    p.read_double("initial_accumulator_value", oc.initial_accumulator_value, Range::at_least(0));
    accepted.push_back("initial_accumulator_value");
  }
  if (const Json* v = p.raw("max_grad_norm"); v != nullptr) {
    ctx.problem("optimizer.params.max_grad_norm",
                "expected no max_grad_norm (DeepSpeed refuses it as an optimizer parameter; use the top-level "
                "gradient_clipping); got " + show(*v));
  }
  p.finish("not a parameter of " + name + "; expected one of " + join(accepted));
  o.finish();
  config.optimizer = oc;
}

void read_scheduler(Section& top, Config& config) {
  Context& ctx = top.context();
  const Json* raw = top.raw("scheduler");
  if (raw == nullptr || raw->is_null()) {
    ctx.record("scheduler", nullptr, Origin::kDefault);
    return;
  }
  Section s = top.child("scheduler", Kind::kPlain);
  if (!s.present()) return;
  const Json* type = s.raw("type");
  static const std::vector<std::pair<std::string, SchedulerType>> kTypes = {
      {"WarmupLR", SchedulerType::kWarmupLR},     {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
      {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}, {"OneCycle", SchedulerType::kOneCycle},
      {"LRRangeTest", SchedulerType::kLRRangeTest}};
  if (type == nullptr || !type->is_string()) {
    ctx.problem("scheduler.type", std::string("expected one of ") + kImplementedSchedulers + "; got " +
                                      (type == nullptr ? "nothing" : show(*type)));
    return;
  }
  const std::string name = type->get<std::string>();
  SchedulerConfig sc;
  bool found = false;
  for (const auto& [n, t] : kTypes) {
    if (n == name) {
      sc.type = t;
      sc.type_name = n;
      found = true;
    }
  }
  if (!found) {
    std::string text = show(*type) + " is not implemented by zero; implemented: " + kImplementedSchedulers;
    for (const auto& [n, t] : kTypes) {
      if (lower(n) == lower(name)) text += " (scheduler names are case-sensitive: did you mean " + n + "?)";
    }
    ctx.problem("scheduler.type", text);
    return;
  }
  ctx.record("scheduler.type", name, Origin::kGiven);
  Section p = s.child("params", Kind::kKwargs);
  config.scheduler = read_scheduler_params(p, sc, ctx.auto_values());
  p.finish("not a parameter of " + name);
  s.finish();
}

}  // namespace zero::config::detail
