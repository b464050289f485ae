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

// NOTE [leaf modules]: on a leaf's outputs, an identity whose backward,
// which runs before the leaf's own, gives every trainable parameter of the
// leaf a zero gradient (expanded: no memory). A parameter the leaf used adds
// its real gradient to it (x + 0 == x); one it did not use gets the zeros,
// so every parameter's gradient arrives during the leaf's backward on every
// rank, and the reductions start in the same order everywhere.
struct LeafGradients : torch::autograd::Function<LeafGradients> {
  static variable_list forward(AutogradContext* ctx, at::TensorList outputs, at::TensorList params) {
    ctx->saved_data["outputs"] = static_cast<int64_t>(outputs.size());
    std::vector<at::Tensor> ps(params.begin(), params.end());
    ctx->saved_data["params"] = c10::List<at::Tensor>(ps);  // shapes and options only are read
    return detached(outputs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t n = ctx->saved_data["outputs"].toInt();
    variable_list out(grads.begin(), grads.begin() + n);
    for (const at::Tensor& p : ctx->saved_data["params"].toTensorList().vec())
      out.push_back(at::zeros({}, p.options()).expand(p.sizes()));
    return out;
  }
};

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

// Every trainable parameter of `module` gets a gradient through `out`
// (NOTE [leaf modules]): `out`'s tensors that need a gradient go through
// LeafGradients.
void leaf_gradients(const torch::nn::Module& module, std::vector<at::Tensor>& out) {
  variable_list params, outs;
  std::vector<size_t> where;
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.requires_grad()) params.push_back(p);
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].defined() && out[i].requires_grad()) {
      outs.push_back(out[i]);
      where.push_back(i);
    }
  }
  if (params.empty() || outs.empty()) return;
  auto touched = LeafGradients::apply(at::TensorList(outs), at::TensorList(params));
  for (size_t k = 0; k < where.size(); ++k) out[where[k]] = touched[k];
}

}  // namespace

bool is_layer(const torch::nn::Module& module) { return partition::find_layer(module).coordinator != nullptr; }

namespace {
constexpr const char* kLeafTag = "_zero_leaf";
// The mark set_leaf leaves: a child without parameters or buffers, as the
// coordinator marks its layers (no process-wide table).
class LeafTagImpl : public torch::nn::Module {};
}  // namespace

void set_leaf(torch::nn::Module& module) {
  if (!is_leaf(module)) module.register_module(kLeafTag, std::make_shared<LeafTagImpl>());
}

bool is_leaf(const torch::nn::Module& module) {
  const auto children = module.named_children();
  const auto* tag = children.find(kLeafTag);
  return tag != nullptr && dynamic_cast<const LeafTagImpl*>(tag->get()) != nullptr;
}

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
    // NOTE [leaf modules], while the parameters have their shapes (autograd
    // records each input's).
    if (grad && h.coordinator->units()[h.unit].leaf) leaf_gradients(module, out);
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
