// NOTE [client optimizer]
// DeepSpeed configs written for a trainer (LLaMA-Factory's, axolotl's,
// FastChat's) often have no `optimizer` section: the trainer builds its own
// optimizer and passes it to deepspeed.initialize. zero takes a
// torch::optim optimizer the same way (InitOptions::optimizer):
// - its type picks zero's flat optimizer: torch's Adam (its weight decay
//   is added to the gradient) is Adam with adam_w_mode false, AdamW is
//   AdamW, Adagrad is Adagrad; any other type is refused, naming it;
// - its defaults become the optimizer section (lr, betas, eps,
//   weight_decay; Adagrad's initial_accumulator_value);
// - each of its parameter groups becomes a ParamGroup with its lr and
//   weight_decay, matched by tensor. zero's flat optimizer keeps one betas
//   and eps: groups that differ there are refused, and so are options it
//   does not have (amsgrad, Adagrad's lr_decay);
// - every trainable parameter of the model must be in a group, and every
//   parameter of a group in the model.
// The optimizer's own state (the moments of one that already stepped) is
// not carried over; a warning says so. When the config has an optimizer
// section too, the config's wins, with a warning: the rule of Hugging Face's
// Trainer, which builds no optimizer when the config has one (DeepSpeed's
// own initialize would take the client's). The program steps through the
// engine afterwards, never through the optimizer.
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <set>
#include <string>
#include <unordered_set>

#include "engine_util.h"
#include "zero/runtime/engine_internal.h"
#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::detail {
namespace {

std::string type_name(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::AdamW*>(&o) != nullptr) return "AdamW";
  if (dynamic_cast<torch::optim::Adam*>(&o) != nullptr) return "Adam";
  if (dynamic_cast<torch::optim::Adagrad*>(&o) != nullptr) return "Adagrad";
  if (dynamic_cast<torch::optim::SGD*>(&o) != nullptr) return "SGD";
  if (dynamic_cast<torch::optim::RMSprop*>(&o) != nullptr) return "RMSprop";
  if (dynamic_cast<torch::optim::LBFGS*>(&o) != nullptr) return "LBFGS";
  return "";
}

// The options zero keeps per group (lr, weight_decay) and for all (betas,
// eps), from one group's options of `type`.
struct GroupOptions {
  double lr = 0, weight_decay = 0, eps = 0, initial_accumulator_value = 0;
  std::array<double, 2> betas{0, 0};
};

GroupOptions read_options(const std::string& type, torch::optim::OptimizerOptions& o, const std::string& where) {
  GroupOptions g;
  if (type == "AdamW") {
    auto& a = static_cast<torch::optim::AdamWOptions&>(o);
    if (a.amsgrad()) throw UsageError(where + ": amsgrad is true; zero's AdamW has no amsgrad (DeepSpeed's neither)");
    g.lr = a.lr(), g.weight_decay = a.weight_decay(), g.eps = a.eps();
    g.betas = {std::get<0>(a.betas()), std::get<1>(a.betas())};
  } else if (type == "Adam") {
    auto& a = static_cast<torch::optim::AdamOptions&>(o);
    if (a.amsgrad()) throw UsageError(where + ": amsgrad is true; zero's Adam has no amsgrad (DeepSpeed's neither)");
    g.lr = a.lr(), g.weight_decay = a.weight_decay(), g.eps = a.eps();
    g.betas = {std::get<0>(a.betas()), std::get<1>(a.betas())};
  } else {
    auto& a = static_cast<torch::optim::AdagradOptions&>(o);
    if (a.lr_decay() != 0)
      throw UsageError(where + ": lr_decay is " + std::to_string(a.lr_decay()) +
                       "; zero's Adagrad has none (a scheduler section sets the lr over time)");
    g.lr = a.lr(), g.weight_decay = a.weight_decay(), g.eps = a.eps();
    g.initial_accumulator_value = a.initial_accumulator_value();
  }
  return g;
}

}  // namespace

void apply_client_optimizer(config::Config& config, InitOptions& options, const torch::nn::Module& model) {
  if (options.optimizer == nullptr) return;
  torch::optim::Optimizer& opt = *options.optimizer;
  options.optimizer = nullptr;  // read once, here
  const bool rank0 = !options.dist || options.dist->rank == 0;
  const std::string type = type_name(opt);
  if (config.optimizer) {
    if (rank0)
      log::warning(config.source + ": optimizer: the config's section (" + config.optimizer->type_name +
                   ") is used, not the program's " + (type.empty() ? "optimizer" : "torch::optim::" + type) +
                   " (InitOptions::optimizer), as Hugging Face's Trainer does; leave the section out to train with the "
                   "program's");
    return;
  }
  if (type != "Adam" && type != "AdamW" && type != "Adagrad")
    throw UsageError("the program's optimizer (InitOptions::optimizer) is " +
                     (type.empty() ? std::string("a torch::optim::Optimizer of a type zero does not know")
                                   : "torch::optim::" + type) +
                     "; zero's flat optimizers are Adam, AdamW and Adagrad (and Lion from a config section): pass one "
                     "of those, or give the config an optimizer section");
  const std::string what = "the program's torch::optim::" + type;
  auto& groups = opt.param_groups();
  if (groups.empty()) throw UsageError(what + ": has no parameter group");
  const GroupOptions defaults = read_options(type, opt.defaults(), what);
  config::OptimizerConfig oc;
  oc.type = type == "AdamW" ? config::OptimizerType::kAdamW
            : type == "Adam" ? config::OptimizerType::kAdam
                             : config::OptimizerType::kAdagrad;
  oc.type_name = type;
  oc.adam_w_mode = type == "AdamW";  // torch's Adam adds its weight decay to the gradient
  oc.lr = defaults.lr;
  oc.weight_decay = defaults.weight_decay;
  oc.eps = defaults.eps;
  oc.betas = defaults.betas;
  oc.initial_accumulator_value = defaults.initial_accumulator_value;

  // Each group, by tensor; one zero ParamGroup where a group's lr or weight
  // decay is not the defaults'.
  std::unordered_set<const void*> in_optimizer;
  std::vector<ParamGroup> made;
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string where = what + " parameter group " + std::to_string(i);
    const GroupOptions g = read_options(type, groups[i].options(), where);
    if (g.betas != defaults.betas || g.eps != defaults.eps || g.initial_accumulator_value != defaults.initial_accumulator_value)
      throw UsageError(where + ": its betas, eps or initial_accumulator_value differ from the optimizer's defaults; zero's "
                       "flat optimizer keeps one of each for all groups (a group may set its own lr and weight_decay)");
    auto tensors = std::make_shared<std::unordered_set<const void*>>();
    for (const auto& p : groups[i].params()) {
      if (!in_optimizer.insert(p.unsafeGetTensorImpl()).second)
        throw UsageError(where + ": holds a parameter another group holds too");
      tensors->insert(p.unsafeGetTensorImpl());
    }
    if (g.lr == defaults.lr && g.weight_decay == defaults.weight_decay) continue;
    ParamGroup pg;
    pg.name = "group " + std::to_string(i);
    pg.lr = g.lr;
    pg.weight_decay = g.weight_decay;
    pg.match = [tensors](const std::string&, const torch::Tensor& t) { return tensors->count(t.unsafeGetTensorImpl()) != 0; };
    made.push_back(std::move(pg));
  }
  // Every trainable parameter of the model is the optimizer's, and nothing else.
  std::vector<std::string> left_out;
  std::unordered_set<const void*> in_model;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    in_model.insert(item.value().unsafeGetTensorImpl());
    if (item.value().requires_grad() && in_optimizer.count(item.value().unsafeGetTensorImpl()) == 0)
      left_out.push_back(item.key());
  }
  if (!left_out.empty()) {
    std::string names;
    for (size_t i = 0; i < left_out.size() && i < 5; ++i) names += (i ? ", " : "") + left_out[i];
    if (left_out.size() > 5) names += " and " + std::to_string(left_out.size() - 5) + " more";
    throw UsageError(what + ": the model's trainable parameter(s) " + names +
                     " are in none of its groups; add them, or freeze them (requires_grad false)");
  }
  for (const void* t : in_optimizer)
    if (in_model.count(t) == 0)
      throw UsageError(what + ": holds a tensor that is no parameter of the model: build it on the model's parameters "
                       "(model->parameters())");
  if (!made.empty() && !options.param_groups.empty())
    throw UsageError(what + ": has parameter groups with their own lr or weight_decay, and InitOptions::param_groups "
                     "gives groups too: give the groups one way");
  for (auto& g : made) options.param_groups.push_back(std::move(g));
  if (!opt.state().empty() && rank0)
    log::warning(what + ": its state (moments of " + std::to_string(opt.state().size()) +
                 " parameter(s)) is not carried over: zero's optimizer starts its own");
  // bf16.bf16_optimizer_states with a bf16 master: bf16 moments, as the
  // config reader sets them for a section (config.cpp; a torch optimizer is
  // never 8-bit, the one combination it refuses).
  if (config.bf16.enabled && config.bf16.bf16_optimizer_states && config.bf16.bf16_master_weights_and_grads &&
      config.zero.stage > 0)
    oc.bf16_states = true;
  config.optimizer = oc;
  if (rank0)
    log::info("optimizer: the program's torch::optim::" + type + " (lr " + std::to_string(oc.lr) + ", weight_decay " +
              std::to_string(oc.weight_decay) + ", " + std::to_string(groups.size()) + " parameter group(s)) as a " +
              "DeepSpeed client optimizer (NOTE [client optimizer])");
}

std::function<std::string(const std::string&)> program_auto_hint(const std::string& program) {
  return [program](const std::string& name) {
    return name == "lr"                               ? std::string("--lr")
           : name == "weight_decay"                   ? std::string("--weight_decay")
           : name == "train_micro_batch_size_per_gpu" ? std::string("--batch_size")
           : name == "precision"                      ? std::string("--precision")
                                                      : "a value written in the config (" + program + " fills no " + name + ")";
  };
}

std::unique_ptr<torch::optim::Optimizer> program_optimizer(const std::string& flag, const std::string& name,
                                                           const std::vector<std::pair<std::vector<torch::Tensor>, double>>& groups,
                                                           double lr) {
  auto make = [&](auto options_of) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (const auto& [params, wd] : groups)
      if (!params.empty()) out.emplace_back(params, std::make_unique<decltype(options_of(0.0))>(options_of(wd)));
    return out;
  };
  if (name == "adamw")
    return std::make_unique<torch::optim::AdamW>(
        make([&](double wd) { return torch::optim::AdamWOptions(lr).weight_decay(wd); }),
        torch::optim::AdamWOptions(lr).weight_decay(groups.empty() ? 0.0 : groups.front().second));
  if (name == "adam")
    return std::make_unique<torch::optim::Adam>(
        make([&](double wd) { return torch::optim::AdamOptions(lr).weight_decay(wd); }),
        torch::optim::AdamOptions(lr).weight_decay(groups.empty() ? 0.0 : groups.front().second));
  if (name == "adagrad")
    return std::make_unique<torch::optim::Adagrad>(
        make([&](double wd) { return torch::optim::AdagradOptions(lr).weight_decay(wd); }),
        torch::optim::AdagradOptions(lr).weight_decay(groups.empty() ? 0.0 : groups.front().second));
  throw UsageError(flag + ": expected adamw, adam or adagrad (a torch::optim optimizer passed as a DeepSpeed client "
                   "optimizer); got \"" + name + "\"");
}

}  // namespace zero::detail
