// The owned partition's optimizer states, wherever they live.
//
// NOTE [state store]
// A rank's owned partition is its chunk of every group, in group order
// (NOTE [flat layout]). The store keeps, for that partition, the master copy
// (fp32, or 16-bit: NOTE [16-bit master] in optim/; named "fp32_master"
// whatever its dtype, in checkpoints too) and the optimizer's states
// ("exp_avg", "exp_avg_sq" for Adam, fp32 or bf16), each group's on one
// tier: the device; host memory (offload_optimizer cpu: pinned when
// pin_memory, within the ledger's pinned limit); or NVMe swap files
// (offload_optimizer nvme, NOTE [optimizer swapping]); a partial offload
// keeps some groups on the device (NOTE [partial offload]), and max_in_cpu
// some of NVMe's in host memory (NOTE [state placement]). At stages 2-3 it
// also keeps the reduced gradient partition (the reducer adds into it; on
// the device in grad_accum_dtype, or, offloaded, in host memory for every
// tier: fp32, or grad_accum_dtype with a 16-bit master or at stage 3, NOTE
// [16-bit gradients]; on the device in that dtype with gradients_on_device,
// NOTE [device gradients]). The master may be the parameters themselves (fp32 compute with
// neither offload nor partitioned optimizer states): then nothing is copied.
//
// The step sees the partition as sub-groups of at most sub_group_size
// elements, never across two groups (sub_groups()), and visits them in
// order (visit()), each as views of its master and states, which on NVMe
// are read in and written back through a few buffers. Every fp32 state is
// addressed the same way on every tier, by name and by (group, element)
// range of the owned partition, which is also how a checkpoint saves and
// reloads it at another world size (each rank's partition maps onto element
// ranges of the global flat layout). A block-wise state (8-bit Adam's codes
// and scales, NOTE [8-bit states]) has its blocks from each sub-group's
// first element, laid out sub-group after sub-group, and so do the fp32
// moments of the blocks that min_8bit_size keeps in fp32 (the store finds
// them from the parameters' places and marks them at init): it is saved as
// it is and, at another layout, requantized on load (engine_checkpoint.cpp).
//
// NOTE [partial offload]
// offload_optimizer.ratio < 1 (DeepSpeed's ZeRO-Offload++ "Twin-Flow", stage
// 3 with offload_optimizer cpu or nvme) keeps a share of the partition's groups on
// the device: their master, states and gradient partition are device
// buffers, their gradients never leave the device, and the step updates
// them there, in place in their shards, while the host's groups go through
// the CPU pass and the pinned buffers as ever. A group lives on one tier
// whole (a group is a layer at stage 3); which ones is host_groups()
// (stage3_rules.h): the host takes the last groups, the device the first.
// DeepSpeed offloads the first int(ratio x count) sub-groups instead (at
// most the ratio); zero offloads the last groups until the host holds at
// least the ratio of the elements (the device never holds more than 1 -
// ratio, what a user sizing the device counts on), and the last because
// backward completes them first: their CPU steps can begin during
// backward (NOTE [speculative step]) while the device steps its share at
// the end in a fraction of the time. Each tier's groups are packed in group
// order in that tier's buffers; sub-groups, names and element ranges are
// the same whatever the placement, so a checkpoint saved at one ratio
// resumes at another, and every ratio steps the same arithmetic where the
// device is the CPU (on a GPU the device's share runs the device's kernels).
// The device's groups keep a master of their own, in fp32 compute too
// (where, without offload, stage 3's shards are the master). The undo copy
// of a speculative step is the host's share alone.
//
// NOTE [state placement]
// Each group's master and states live whole on one of three tiers, laid out
// in group order: the device holds the first groups (at most 1 - ratio of
// the partition, NOTE [partial offload]; the ratio, not the device's free
// memory, sets its share), host memory the next, and with
// offload_optimizer nvme the swap files the rest. offload_optimizer.max_in_cpu (zero's
// own key, named after offload_param's: elements of the partition; 0 by
// default, every offloaded group on NVMe as before it existed) keeps the
// first offloaded groups in host memory while they fit within it, and the
// rest go to NVMe (state_tiers() in stage3_rules.h). So the disk's groups
// are the last ones: a pass steps the memory's sub-groups, then the disk's
// through the swapper, whose first reads (pipeline_read) run while the
// memory's are stepped, and the pass is still in sub-group order. Every
// offloaded group's gradient partition is in host memory (or, with
// gradients_on_device, on the device) whichever tier holds its states. The
// bytes and the arithmetic are the same on every tier, so each placement
// gives the bits of all in host memory, and a checkpoint (by sub-group and
// element range) resumes at any other. The device's share comes with cpu or
// nvme alike; only the NVMe share reads and writes the disk.
//
// NOTE [device gradients]
// offload_optimizer.gradients_on_device (zero's own key; stages 2-3) keeps
// the reduced gradient partition on the device, in the dtype it has in host
// memory when offloaded (fp32 at stage 2 with an fp32 master, else
// grad_accum_dtype), while the master and states are offloaded: the reducer adds each reduced chunk
// into it there, as without offload, and the step brings each sub-group's
// gradient to the host a piece (host_staging_numel) at a time, one piece
// ahead of the CPU pass, through two pinned buffers, as stage 1 always has
// (ZeroOptimizer::GradFetch). It moves those bytes a parameter of host
// memory to the device: where the host is the tier that is full (a 16-bit master
// and 8-bit moments offloaded, the parameters and their gradients on a
// large device), a larger model fits. The copies run at the step, not
// behind backward, so the step waits for them where the copy of the next
// piece outlasts the CPU's step of this one; super_offload, which steps
// the host's gradients during backward, does not go with it. The same
// gradients in the same dtype reach the same CPU pass: the bits of the
// gradients on the host.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/core/ledger_alloc.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/stage3_rules.h"
#include "zero/partition/state_swapper.h"

namespace zero::partition {

struct StoreOptions {
  at::Device device = at::kCPU;
  /// offload_optimizer (cpu or nvme): the states live in host memory (or on NVMe).
  bool offload = false;
  /// offload_optimizer.ratio: the share of the partition offloaded, the
  /// rest on the device (NOTE [partial offload]).
  double ratio = 1.0;
  /// offload_optimizer.max_in_cpu, with nvme: elements of the offloaded
  /// groups kept in host memory, the first ones (NOTE [state placement]).
  int64_t max_in_cpu = 0;
  bool pin_memory = true;
  /// offload_optimizer nvme: master and states in swap files.
  std::optional<SwapOptions> nvme;
  int64_t sub_group_size = 1000000000;
  /// Stages 2-3: keep the reduced gradient partition, in `grad_dtype` on
  /// the device (offloaded: in host memory, fp32, or `grad_dtype` with a
  /// 16-bit master).
  bool grad_partition = false;
  at::ScalarType grad_dtype = at::kFloat;
  /// Offloaded, the partition's dtype when set (stage 3: `grad_dtype`, NOTE
  /// [16-bit gradients]); else the rule above.
  std::optional<at::ScalarType> host_grad_dtype;
  /// offload_optimizer.gradients_on_device: the gradient partition stays on
  /// the device, in the dtype it has offloaded (NOTE [device gradients]).
  bool grads_on_device = false;
  /// The master's dtype: fp32, or bf16/fp16 (bf16_master_weights_and_grads,
  /// fp16_master_weights_and_grads: NOTE [16-bit master] in optim/).
  at::ScalarType master_dtype = at::kFloat;
  /// Which rank's chunks of the flat layout the partition is (0 when it is
  /// one partition): which parameters' elements it holds (min_8bit_size).
  int64_t layout_rank = 0;
};

/// A piece of the owned partition the step handles at once.
struct SubGroup {
  size_t group;
  int64_t start, numel;  // within the group's chunk
};

class StateStore {
 public:
  /// Where the master of group g is, when it is the parameters themselves
  /// (fp32 on the device); see NOTE.
  using ParamMaster = std::function<at::Tensor(size_t g)>;

  /// Lays out the partition of `params` and allocates what lives in memory
  /// (values undefined until init()). Throws OutOfMemoryError, ConfigError
  /// (a bad NVMe option or path), IoError (no room for the swap files).
  StateStore(const FlatParameters& params, const optim::FlatOptimizer& optimizer, StoreOptions options,
             MemoryLedger& ledger, ParamMaster param_master = nullptr);
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  /// Sets the master from `chunk(g)` (this rank's chunk of group g, in the
  /// compute dtype; `done(g)` is called after its last use) and the states to
  /// the optimizer's initial values. Nothing is copied when the master is the
  /// parameters. Throws IoError (NVMe).
  void init(const std::function<at::Tensor(size_t g)>& chunk, const std::function<void(size_t g)>& done);

  const std::vector<SubGroup>& sub_groups() const { return sub_groups_; }
  /// "fp32_master", then the optimizer's state names.
  const std::vector<std::string>& names() const { return names_; }
  /// The value optimizer state `i` (0-based, after the master) starts at.
  double initial_value(size_t i) const { return initial_.at(i); }
  /// The optimizer's states: dtype and layout (8-bit Adam's are bytes and
  /// block scales, NOTE [8-bit states]); a block-wise state is laid out
  /// sub-group by sub-group.
  const std::vector<optim::FlatOptimizer::StateSpec>& state_specs() const { return specs_; }
  /// State i's length for sub-group k.
  int64_t state_numel(size_t i, size_t k) const;
  /// 8-bit Adam with min_8bit_size: the blocks of sub-group k (from its
  /// first element) whose moments stay fp32, because they hold an element of
  /// a parameter with fewer elements (NOTE [8-bit states]); in order.
  const std::vector<int64_t>& fp32_blocks(size_t k) const { return fp32_blocks_.at(k); }
  /// Sets sub-group k's states `st` (as visit() gives them) to where they
  /// start: the optimizer's initial values, its fp32 blocks marked.
  void start_states(size_t k, std::vector<at::Tensor>& st) const;

  using Visit = std::function<void(size_t k, at::Tensor master, std::vector<at::Tensor> states)>;
  /// Visits every sub-group in order with views of its master (master_dtype()) and
  /// states (as state_specs()). `write_back`: changes are kept (NVMe: written back). Throws IoError.
  void visit(bool write_back, const Visit& fn);
  /// NVMe with pipeline_read: starts reading the first sub-groups for the
  /// next visit (behind backward). Never throws.
  void prefetch();

  /// Sub-group k's master, then its states, as visit() gives them (in
  /// memory; not on NVMe): any thread may step a sub-group no other touches.
  std::vector<at::Tensor> views(size_t k) const;

  /// The master of group g (in memory; not on NVMe).
  at::Tensor master(size_t g) const;
  /// The state `i` (0-based among the optimizer's states) of group g (in
  /// memory, not on NVMe); a block-wise state's blocks of g's sub-groups.
  at::Tensor state(size_t i, size_t g) const;

  /// Stages 2-3: this rank's reduced gradient of group g.
  at::Tensor grad(size_t g) const;
  bool has_grads() const { return grad_partition_; }
  void zero_grads();

  /// Where the offloaded groups' master and states live: a host tier, or
  /// kNvme when some are on NVMe (kDevice when nothing is offloaded).
  Tier tier() const { return tier_; }
  /// offload_optimizer is on (some or all groups live off the device).
  bool offloaded() const { return options_.offload; }
  /// Whether group g's master, states and gradient partition are off the
  /// device (NOTE [partial offload]).
  bool on_host(size_t g) const { return host_.at(g) != kStatesOnDevice; }
  /// Whether group g's master and states are in the swap files (NOTE [state
  /// placement]).
  bool on_nvme(size_t g) const { return host_.at(g) == kStatesOnNvme; }
  /// Whether group g's gradient partition is in host memory (its states
  /// there, and not gradients_on_device).
  bool grad_on_host(size_t g) const { return on_host(g) && !options_.grads_on_device; }
  bool master_is_param() const { return param_master_ != nullptr; }
  at::ScalarType master_dtype() const { return options_.master_dtype; }
  /// The NVMe swapper (null unless nvme).
  const StateSwapper* swapper() const { return swapper_.get(); }

 private:
  const FlatParameters& params_;
  StoreOptions options_;
  MemoryLedger& ledger_;
  ParamMaster param_master_;
  std::vector<double> initial_;        // per optimizer state: its starting value
  std::vector<optim::FlatOptimizer::StateSpec> specs_;
  std::vector<std::vector<int64_t>> state_at_;  // per state: where each sub-group's part starts, in its tier's buffer
  std::vector<SubGroup> sub_groups_;
  std::vector<std::vector<int64_t>> fp32_blocks_;  // per sub-group (min_8bit_size)
  std::vector<std::string> names_;
  Tier tier_ = Tier::kDevice;
  std::vector<char> host_;              // per group: its StateTier (NOTE [state placement])
  size_t first_disk_ = 0;               // the first sub-group on NVMe (all of them: none)
  std::vector<int64_t> at_;             // per group: its chunk's offset in its tier's buffers
  std::vector<std::vector<int64_t>> state_len_;  // per state: each sub-group's length
  // Per tier (0: the device, 1: off it), each tier's groups in group order
  // (memory tiers; the master and states of the groups in host memory, which
  // come first among those off the device, and the gradients of all of them).
  struct Buffers {
    at::Tensor master;
    std::vector<at::Tensor> states;     // one per optimizer state
    at::Tensor grads;                   // stages 2-3
  };
  Buffers tiers_[2];
  bool grad_partition_ = false;
  std::unique_ptr<StateSwapper> swapper_;

  const Buffers& buffers_of(size_t g) const { return tiers_[host_[g] ? 1 : 0]; }
  at::Tensor chunk_of(const at::Tensor& buf, size_t g) const;
  // Sub-group k's views of the states in memory.
  std::vector<at::Tensor> sub_group_states(size_t k) const;
};

}  // namespace zero::partition
