#include "zero/partition/layer.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>

#include "zero/core/error.h"
#include "zero/partition/stage3.h"

namespace zero {
namespace {

using partition::LayerHandle;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a boundary node keeps of its layer: the coordinator, weakly (NOTE
// [stage-3 layers]), and the unit.
struct LayerRef : torch::CustomClassHolder {
  std::weak_ptr<partition::Stage3Coordinator> coordinator;
  size_t unit = 0;
};

void save_handle(AutogradContext* ctx, const LayerHandle& h) {
  auto ref = c10::make_intrusive<LayerRef>();
  ref->coordinator = h.coordinator;
  ref->unit = h.unit;
  ctx->saved_data["layer"] = c10::IValue::make_capsule(std::move(ref));
}

LayerHandle load_handle(AutogradContext* ctx) {
  auto ref = c10::static_intrusive_pointer_cast<LayerRef>(ctx->saved_data["layer"].toCapsule());
  LayerHandle h{ref->coordinator.lock(), ref->unit};
  if (h.coordinator == nullptr) {
    throw UsageError("backward through a ZeRO stage-3 layer whose engine is gone: the engine must outlive the "
                     "graphs built through its layers");
  }
  return h;
}

// New tensors on the same memory: returned as they are, autograd would make
// them views created in a custom Function, which refuse in-place operations
// (a Sequential with ReLU(inplace) after a layer, say).
variable_list detached(at::TensorList ts) {
  variable_list out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.detach());
  return out;
}

// An identity on a layer's boundary. On its outputs (kPre) its backward runs
// before the layer's backward, so it gathers the layer again; on its inputs
// its backward runs once the gradient has gone through the layer, so it
// releases the layer.
template <bool kPre>
struct Boundary : torch::autograd::Function<Boundary<kPre>> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, LayerHandle h) {
    save_handle(ctx, h);
    return detached(tensors);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto h = load_handle(ctx);
    if (kPre) h.coordinator->pre_backward(h.unit);
    else h.coordinator->post_backward(h.unit);
    grads.emplace_back();  // for the handle argument
    return grads;
  }
};
using PreBackward = Boundary<true>;
using PostBackward = Boundary<false>;

// Applies F to the tensors of `ts` that need a gradient, in place in `ts`.
template <typename F>
void wrap(std::vector<at::Tensor>& ts, const LayerHandle& h) {
  variable_list sel;
  std::vector<size_t> where;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].defined() && ts[i].requires_grad()) {
      sel.push_back(ts[i]);
      where.push_back(i);
    }
  }
  if (sel.empty()) return;
  // As a TensorList: Function::apply counts its elements as inputs (a vector would be one opaque argument).
  auto out = F::apply(at::TensorList(sel), h);
  for (size_t k = 0; k < where.size(); ++k) ts[where[k]] = out[k];
}

}  // namespace

bool is_layer(const torch::nn::Module& module) { return partition::find_layer(module).coordinator != nullptr; }

std::vector<at::Tensor> layer_forward(
    const torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn) {
  const LayerHandle h = partition::find_layer(module);
  if (h.coordinator == nullptr) return fn(inputs);
  const bool grad = at::GradMode::is_enabled();
  std::vector<at::Tensor> in = inputs;
  if (grad) wrap<PostBackward>(in, h);
  h.coordinator->pre_forward(h.unit);
  std::vector<at::Tensor> out;
  try {
    out = fn(in);
  } catch (...) {
    h.coordinator->post_forward(h.unit);
    throw;
  }
  h.coordinator->post_forward(h.unit);
  if (grad) wrap<PreBackward>(out, h);
  return out;
}

at::Tensor layer_forward(const torch::nn::Module& module, const at::Tensor& input,
                         const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return layer_forward(module, std::vector<at::Tensor>{input},
                       [&](const std::vector<at::Tensor>& v) { return std::vector<at::Tensor>{fn(v[0])}; })
      .at(0);
}

}  // namespace zero
