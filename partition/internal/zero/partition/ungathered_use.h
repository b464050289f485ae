// NOTE [ungathered use]
// At stage 3 a layer's parameters are empty tensors except while the layer
// runs through zero::forward (NOTE [stage-3 layers]). A model that calls a
// layer's forward directly uses them empty, and LibTorch fails somewhere
// inside with a message about shapes ("The size of tensor a (64) must
// match the size of tensor b (0)") that names neither the layer nor the
// cause. LibTorch's modules have no hooks to catch the call, so this watches
// the operators instead: while one of these lives, a RecordFunction callback
// looks at each operator's tensor inputs for a layer parameter left empty
// and, the first time it finds one of a layer, prints which parameter of
// which layer, which operator, and that a layer's forward must run through
// zero::forward; then LibTorch's own error follows. Watching every operator
// costs time, so the coordinator keeps one only through the first forward
// (until a layer runs again, or the first micro-step ends), which is where a
// missing zero::forward shows; a direct call made only later (an evaluation
// path after training) gets LibTorch's error alone. RecordFunction takes
// a plain function pointer, so the parameters watched are in one
// process-wide table (guarded by a lock) holding the entries of the watches
// alive; each watch takes its own out when it goes.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>

#include <ATen/record_function.h>

namespace zero::partition {

class UngatheredUseCheck {
 public:
  /// What to name for each parameter watched: its name and its layer's.
  struct Param {
    std::string name, layer;
  };
  /// Starts watching `params` (by TensorImpl: the parameter's identity
  /// survives set_data). Thread-safe.
  explicit UngatheredUseCheck(std::unordered_map<const c10::TensorImpl*, Param> params);
  /// Stops watching.
  ~UngatheredUseCheck();
  UngatheredUseCheck(const UngatheredUseCheck&) = delete;
  UngatheredUseCheck& operator=(const UngatheredUseCheck&) = delete;


 private:
  std::unordered_map<const c10::TensorImpl*, Param> params_;
  // A flag per layer: each layer's first use is reported once.
  std::unordered_map<std::string, std::shared_ptr<std::atomic<bool>>> said_;
  at::CallbackHandle handle_ = 0;
};

}  // namespace zero::partition
