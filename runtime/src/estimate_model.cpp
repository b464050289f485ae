// zero::parameter_shapes and zero::estimate of a model itself
// (zero/runtime/estimate.h): its parameters and stage-3 layers found as the
// stage-3 plan finds them (NOTE [stage-3 plan]).
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include "zero/runtime/engine.h"
#include "zero/runtime/estimate.h"

namespace zero {

std::vector<ParameterShape> parameter_shapes(const torch::nn::Module& model,
                                             const std::vector<std::shared_ptr<torch::nn::Module>>& layers) {
  std::unordered_set<const torch::nn::Module*> extra;
  for (const auto& l : layers) extra.insert(l.get());
  // The layers, in the model's order (a pre-order walk), none inside another.
  std::vector<const torch::nn::Module*> found;
  std::function<void(const torch::nn::Module&, bool)> walk = [&](const torch::nn::Module& m, bool inside) {
    const bool container = dynamic_cast<const torch::nn::ModuleListImpl*>(&m) != nullptr ||
                           dynamic_cast<const torch::nn::SequentialImpl*>(&m) != nullptr;
    for (const auto& child : m.children()) {
      const bool layer = !inside && (container || extra.count(child.get()) > 0);
      if (layer) found.push_back(child.get());
      walk(*child, inside || layer);
    }
  };
  walk(model, false);
  std::unordered_map<const void*, int> layer_of;  // a parameter's first layer
  for (size_t k = 0; k < found.size(); ++k)
    for (const auto& p : found[k]->parameters(/*recurse=*/true))
      layer_of.emplace(p.unsafeGetTensorImpl(), static_cast<int>(k));
  std::vector<ParameterShape> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const auto it = layer_of.find(p.unsafeGetTensorImpl());
    out.push_back({item.key(), p.numel(), it == layer_of.end() ? -1 : it->second, !p.requires_grad()});
  }
  return out;
}

MemoryEstimate estimate(const torch::nn::Module& model, const config::Config& config, const InitOptions& options) {
  auto layers = options.layers;  // NOTE [leaf modules]: a leaf is a layer
  layers.insert(layers.end(), options.leaf_modules.begin(), options.leaf_modules.end());
  return estimate_model_states(config, parameter_shapes(model, layers));
}

}  // namespace zero
