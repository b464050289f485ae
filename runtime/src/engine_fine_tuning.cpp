// The fine-tuning loop's side of the Engine (engine.h): which parameters
// train, by name (trainable_matching, frozen_matching; NOTE [frozen
// groups]), and the optimizer's groups at run time (set_lr,
// set_weight_decay, param_groups).
#include <cmath>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "engine_impl.h"
#include "zero/core/error.h"

namespace zero {

namespace {
std::function<bool(const std::string&)> matching(const std::vector<std::string>& patterns, bool trains,
                                                 const char* what) {
  std::vector<std::regex> res;
  for (size_t i = 0; i < patterns.size(); ++i) {
    try {
      res.emplace_back(patterns[i], std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw ConfigError({std::string(what) + "[" + std::to_string(i) + "]: expected a regular expression; got \"" +
                         patterns[i] + "\" (" + e.what() + ")"});
    }
  }
  return [res = std::move(res), trains](const std::string& name) {
    for (const auto& re : res)
      if (std::regex_search(name, re)) return trains;
    return !trains;
  };
}
}  // namespace

std::function<bool(const std::string&)> trainable_matching(const std::vector<std::string>& patterns) {
  return matching(patterns, true, "trainable_matching");
}
std::function<bool(const std::string&)> frozen_matching(const std::vector<std::string>& patterns) {
  return matching(patterns, false, "frozen_matching");
}

namespace {
// The optimizer's groups made explicit (one "default" group of every
// parameter) for a change to one group.
void ensure_param_groups(Engine::Impl& s) {
  if (!s.optimizer->param_groups().empty()) return;
  s.optimizer->set_param_groups({{"default", std::nullopt, std::nullopt}},
                                std::vector<size_t>(s.optimizer->parameters().slots().size(), 0));
}
size_t group_index(const Engine::Impl& s, std::optional<size_t> group, const char* what) {
  const size_t n = std::max<size_t>(1, s.optimizer->param_groups().size());
  if (group && *group >= n)
    throw UsageError(std::string(what) + ": group " + std::to_string(*group) + " does not exist; the optimizer has " +
                     std::to_string(n) + " (param_groups())");
  return group.value_or(0);
}
}  // namespace

void Engine::set_lr(double lr, std::optional<size_t> group) {
  auto& s = *impl_;
  if (!(lr >= 0) || !std::isfinite(lr)) throw UsageError("set_lr: expected a finite lr >= 0; got " + std::to_string(lr));
  group_index(s, group, "set_lr");
  if (!group) {
    s.lr_set = lr;
    for (size_t g = 0; g < s.optimizer->param_groups().size(); ++g) {
      auto h = s.optimizer->param_groups()[g];
      h.lr_set = lr;
      s.optimizer->set_group_hyper(g, h);
    }
    return;
  }
  if (s.optimizer->param_groups().empty()) {  // the one group
    s.lr_set = lr;
    return;
  }
  auto h = s.optimizer->param_groups()[*group];
  h.lr_set = lr;
  s.optimizer->set_group_hyper(*group, h);
}

void Engine::set_weight_decay(double weight_decay, std::optional<size_t> group) {
  auto& s = *impl_;
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
    throw UsageError("set_weight_decay: expected a finite weight decay >= 0; got " + std::to_string(weight_decay));
  group_index(s, group, "set_weight_decay");
  ensure_param_groups(s);
  for (size_t g = 0; g < s.optimizer->param_groups().size(); ++g) {
    if (group && g != *group) continue;
    auto h = s.optimizer->param_groups()[g];
    h.weight_decay = weight_decay;
    s.optimizer->set_group_hyper(g, h);
  }
}

std::vector<ParamGroupState> Engine::param_groups() const {
  const auto& s = *impl_;
  const double lr = s.current_lr(), base = s.optimizer->optimizer_config().lr;
  const double wd = s.optimizer->optimizer_config().weight_decay;
  const auto& groups = s.optimizer->param_groups();
  if (groups.empty()) return {{"default", lr, wd, s.optimizer->num_parameters()}};
  const auto numels = s.optimizer->param_group_numels();
  std::vector<ParamGroupState> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& h = groups[g];
    const double glr = h.lr_set ? *h.lr_set : h.lr ? (base > 0 ? lr * (*h.lr / base) : *h.lr) : lr;
    out.push_back({h.name, glr, h.weight_decay.value_or(wd), numels[g]});
  }
  return out;
}

}  // namespace zero
