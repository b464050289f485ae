#include "zero/partition/ungathered_use.h"

#include <cstring>
#include <mutex>
#include <shared_mutex>

#include <ATen/core/Tensor.h>

#include "zero/core/log.h"

namespace zero::partition {
namespace {

struct Watched {
  UngatheredUseCheck::Param param;
  std::shared_ptr<std::atomic<bool>> said;  // its layer's: reported once
};

// NOTE [ungathered use]: the table RecordFunction's plain function pointer
// reads. Never destroyed (callbacks may run while the process exits).
std::shared_mutex& table_mutex() {
  static auto* m = new std::shared_mutex;
  return *m;
}
std::unordered_map<const c10::TensorImpl*, Watched>& table() {
  static auto* t = new std::unordered_map<const c10::TensorImpl*, Watched>;
  return *t;
}

std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  // The coordinator's own rebinding of a parameter (set_data, and the check
  // set_data makes first) is not a use.
  const char* op = fn.name();
  if (std::strcmp(op, "aten::set_data") == 0 || std::strcmp(op, "aten::_has_compatible_shallow_copy_type") == 0)
    return nullptr;
  for (const c10::IValue& v : fn.inputs()) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || t.numel() != 0) continue;  // a gathered parameter is not empty
    std::shared_lock lock(table_mutex());
    const auto it = table().find(t.unsafeGetTensorImpl());
    if (it == table().end() || it->second.said->exchange(true)) continue;
    log::error("stage 3: parameter " + it->second.param.name + " of layer " + it->second.param.layer +
               " is used by " + op + " while the layer is not gathered (each rank holds only its shard), as when "
               "the layer's forward is called directly: call it as zero::forward(layer, inputs...) "
               "(zero/partition/layer.h), which gathers its parameters for the call; an error of LibTorch's about "
               "the empty parameter may follow");
  }
  return nullptr;
}

}  // namespace

UngatheredUseCheck::UngatheredUseCheck(std::unordered_map<const c10::TensorImpl*, Param> params)
    : params_(std::move(params)) {
  if (params_.empty()) return;
  for (const auto& [impl, p] : params_)
    if (said_.count(p.layer) == 0) said_.emplace(p.layer, std::make_shared<std::atomic<bool>>(false));
  {
    std::unique_lock lock(table_mutex());
    for (const auto& [impl, p] : params_) table()[impl] = Watched{p, said_.at(p.layer)};
  }
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(on_operator).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
}

UngatheredUseCheck::~UngatheredUseCheck() {
  if (handle_ != 0) at::removeCallback(handle_);
  std::unique_lock lock(table_mutex());
  for (const auto& [impl, p] : params_) {
    const auto it = table().find(impl);
    if (it != table().end() && it->second.said == said_.at(p.layer)) table().erase(it);
  }
}

}  // namespace zero::partition
