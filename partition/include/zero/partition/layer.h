// Running a layer under ZeRO stage 3 (NOTE [stage-3 layers]).
//
// LibTorch modules have no forward hooks, so a model trained at stage 3 runs
// each layer it wants gathered layer by layer through this function:
//
//   for (auto& item : *blocks_) x = zero::forward(item->as<Block>(), x);
//
// The engine makes the children of every ModuleList and Sequential layers
// (plus InitOptions::layers); a Sequential's forward calls its entries
// through here already. When the module is not a layer (no engine, or a
// stage below 3) this is just module->forward(inputs...). Parameters of a
// layer are released outside its forward: reading them there fails with a
// shape error (they are empty tensors).
//
// Throws what the layer's forward throws, and from the gather:
// zero::CommunicationError (a rank died, hung, or runs other layers),
// zero::IoError (a shard on NVMe could not be read). Backward through a
// layer whose engine is gone throws zero::UsageError. Called by the training
// thread only.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace zero {

/// True when `module` is a stage-3 layer of a live engine.
bool is_layer(const torch::nn::Module& module);

/// Runs fn(inputs) as layer `module`: gathers its parameters, runs fn,
/// releases them, and arranges the same around the layer's backward.
std::vector<at::Tensor> layer_forward(
    const torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn);

/// The same for one input and one output.
at::Tensor layer_forward(const torch::nn::Module& module, const at::Tensor& input,
                         const std::function<at::Tensor(const at::Tensor&)>& fn);

/// module->forward(inputs...) as a stage-3 layer; `module` is a module holder
/// (Linear, a TORCH_MODULE) or a pointer to the module; inputs are tensors.
template <typename M, typename... Tensors>
at::Tensor forward(M&& module, const Tensors&... inputs) {
  std::vector<at::Tensor> in{inputs...};
  auto out = layer_forward(*module, in, [&](const std::vector<at::Tensor>& v) {
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return std::vector<at::Tensor>{module->forward(v[I]...)};
    }(std::index_sequence_for<Tensors...>{});
  });
  return out.at(0);
}

}  // namespace zero
