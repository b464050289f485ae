// The two rules of NOTE [stage-3 plan] that zero::Init, the plan and the
// parameter swapper share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace zero::partition {

/// Which parameters stay whole: under stage3_param_persistence_threshold,
/// while their sum stays under stage3_model_persistence_threshold.
class PersistenceRule {
 public:
  PersistenceRule(int64_t param_threshold = 0, int64_t model_threshold = std::numeric_limits<int64_t>::max())
      : param_threshold_(param_threshold), model_left_(model_threshold) {}
  /// Whether a parameter of `numel` elements stays whole; if so it counts
  /// against the model's budget.
  bool keep_whole(int64_t numel) {
    if (numel >= param_threshold_ || numel > model_left_) return false;
    model_left_ -= numel;
    return true;
  }

 private:
  int64_t param_threshold_;
  int64_t model_left_;
};

/// Which shards stay in host memory with offload_param nvme: in order, while
/// the shards kept sum to at most max_in_cpu.
class InCpuBudget {
 public:
  explicit InCpuBudget(int64_t max_in_cpu = std::numeric_limits<int64_t>::max())
      : left_(std::max<int64_t>(0, max_in_cpu)) {}
  /// Whether a shard of `numel` elements stays in host memory; if so it
  /// counts against the budget.
  bool keep(int64_t numel) {
    if (numel > left_) return false;
    left_ -= numel;
    return true;
  }

 private:
  int64_t left_;
};

}  // namespace zero::partition
