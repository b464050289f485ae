// The two rules of NOTE [stage-3 plan] that zero::Init, the plan and the
// parameter swapper share, and the optimizer states' placement (partial
// offload, max_in_cpu), which the state store and the estimator share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

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

/// offload_optimizer.ratio (NOTE [partial offload] in state_store.h): for
/// each group of `chunks` elements (this rank's, in layout order), whether
/// its optimizer states go to the host. From the last group back (the first
/// that backward completes), groups go to the host while the host holds
/// less than `ratio` of the elements; the rest stay on the device. So the
/// host holds at least `ratio` of them, the device at most 1 - ratio (the
/// group that straddles the line goes to the host). Ratio 1: every group.
inline std::vector<char> host_groups(const std::vector<int64_t>& chunks, double ratio) {
  int64_t total = 0;
  for (int64_t n : chunks) total += n;
  std::vector<char> host(chunks.size(), 0);
  int64_t held = 0;
  for (size_t i = chunks.size(); i-- > 0;) {
    if (ratio < 1.0 && static_cast<double>(held) >= ratio * static_cast<double>(total)) break;
    host[i] = 1;
    held += chunks[i];
  }
  return host;
}

/// Where a group's optimizer states live (NOTE [state placement] in
/// state_store.h).
enum StateTier : char { kStatesOnDevice = 0, kStatesInHostMemory = 1, kStatesOnNvme = 2 };

/// The tier of each group's optimizer states: the device keeps the groups
/// host_groups() leaves it (offload_optimizer.ratio); with `nvme`, of the
/// offloaded groups, in group order, the first stay in host memory while
/// their elements sum to at most `max_in_cpu` (offload_optimizer.max_in_cpu),
/// and from the first that does not fit on, every one is on NVMe. (Unlike
/// offload_param.max_in_cpu, which keeps any later shard that still fits:
/// the disk's groups are the last ones, one run a pass reads behind the
/// memory's.)
inline std::vector<char> state_tiers(const std::vector<int64_t>& chunks, double ratio, bool nvme, int64_t max_in_cpu) {
  std::vector<char> tier = host_groups(chunks, ratio);
  if (!nvme) return tier;
  int64_t left = std::max<int64_t>(0, max_in_cpu);
  bool disk = false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (tier[i] == kStatesOnDevice) continue;
    if (!disk && chunks[i] <= left) {
      left -= chunks[i];
    } else {
      disk = true;
      tier[i] = kStatesOnNvme;
    }
  }
  return tier;
}

}  // namespace zero::partition
