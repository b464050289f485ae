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

// NOTE [leaf modules]
// Stage 3 gathers a layer's parameters around its forward, and every rank
// must gather the same layers in the same order (NOTE [stage-3 trace]). A
// module whose children run or not by the data (a mixture of experts that
// skips an expert without tokens, a branch on a flag of the batch) breaks
// that when its children are layers: ranks gather different ones and fail
// ("ranks run different layers"). A leaf module (DeepSpeed's
// set_z3_leaf_modules) is one layer instead: all its parameters are
// gathered before it runs and released after, whatever subset of them is
// used, and no module inside it is a layer of its own. Its gradients are
// reduced whole on every rank, zeros for the parameters this rank did not
// use (the reducer launches a group whose gradients did not all arrive
// when backward ends, NOTE [gradient path]), so the collectives match. It
// costs gathering the experts that do not run here; it saves a hang.

/// Makes `module` a stage-3 leaf module (NOTE [leaf modules]) of the engine
/// that will be made for a model holding it: call it before initialize.
/// Its forward must run through zero::forward / zero::layer_forward, as a
/// layer's. Same as listing it in InitOptions::leaf_modules.
void set_leaf(torch::nn::Module& module);
/// True when set_leaf marked `module`.
bool is_leaf(const torch::nn::Module& module);

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
