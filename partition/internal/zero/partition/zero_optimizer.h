// The ZeRO optimizer: owns the flat parameters, the gradients, the fp32
// master copy and the optimizer states, reduces gradients across ranks, and
// applies one optimizer step at each accumulation boundary.
//
// NOTE [gradient path]
// Each trainable parameter has a post-accumulate-grad hook. When autograd has
// produced a parameter's gradient, the hook adds it into a flat buffer (in
// grad_accum_dtype) and frees the per-parameter gradient. When every parameter
// of a group (bucket, NOTE [flat layout]) has reported, the group's collective
// starts on the communication backend's threads while backward goes on;
// groups start in one fixed order on every rank, so collectives match.
//   stage 0: full gradients; at the boundary micro-step, each group is
//            all-reduced; every rank updates the whole model.
//   stage 1: full gradients accumulate over micro-steps; at the boundary each
//            group is all-reduced in place and each rank uses its own chunk;
//            master and optimizer states exist only for the owned partition;
//            updated chunks are all-gathered.
//   stage 2 and 3: no full gradient buffer: each group's gradients land in a staging
//            buffer that is reduce-scattered every micro-step as soon as the
//            group is complete, and the rank's chunk is added into its owned
//            gradient partition; staging is freed as each collective ends.
//   stage 3: also no full parameter buffer: each layer's parameters are
//            gathered when it runs (NOTE [stage-3 layers]); the optimizer
//            writes this rank's partition, and nothing is all-gathered
//            after the step but the always-gathered group.
// Reductions sum; the 1/world_size of the average is folded into the single
// unscale-and-clip factor of step(). The global gradient norm sums the owned
// partitions of all ranks, so clipping and the fp16 overflow check (a
// non-finite norm) agree on every rank.
//
// Thread-safety: hooks run on autograd's thread during backward; the Engine
// does not call anything else meanwhile.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/config/config.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/core/comm.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/stage3.h"
#include "zero/partition/param_swapper.h"
#include "zero/partition/state_swapper.h"
#include "zero/partition/host_ring.h"

namespace zero::partition {

struct ZeroOptimizerOptions {
  int stage = 0;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType grad_accum_dtype = at::kFloat;
  at::Device device = at::kCPU;
  int64_t sub_group_size = 1000000000;
  /// Elements per group (bucket): reduce_bucket_size (stage 1/2 also bounded
  /// by allgather_bucket_size).
  int64_t bucket_numel = 500000000;
  /// Start collectives during backward while it goes on; false: stages 0-1
  /// reduce at the end of backward, stages 2-3 reduce each complete bucket
  /// and wait for it before backward continues.
  bool overlap_comm = true;
  /// Skip the step when gradients are not finite (fp16 always; bf16 when
  /// bf16.check_grad_overflow).
  bool check_overflow = true;
  /// offload_optimizer.device = cpu (stages 1 and 2): fp32 master, optimizer
  /// states and (stage 2) the fp32 gradient partition live in host memory and
  /// the optimizer runs on the CPU; see NOTE [optimizer offload].
  bool offload_optimizer = false;
  /// offload_optimizer.pin_memory: the host buffers are page-locked (the
  /// pinned-host tier), as far as the ledger's pinned limit allows.
  bool pin_memory = true;
  /// offload_optimizer.device = nvme: as offload_optimizer, but the fp32
  /// master and the optimizer states live in swap files and are stepped
  /// sub-group by sub-group (NOTE [optimizer swapping]); the gradient
  /// partition stays in host memory.
  std::optional<SwapOptions> nvme;
  /// On the CPU: CopyMode::kDeferred makes every device-host transfer wait
  /// for its event (tests, NOTE [device streams]).
  CopyMode copy_mode = CopyMode::kImmediate;
};

// NOTE [optimizer offload]
// With offload_optimizer, the states of the owned partition are host buffers:
// the reduced gradient chunks are copied device-to-host as each bucket's
// reduction completes (stage 2; stage 1 copies its owned chunk at the step),
// the CPU Adam kernel updates master and moments in host memory, and the new
// values go back host-to-device in the compute dtype (all-gathered across
// ranks). On a machine without a GPU the "device" is the CPU and the same
// path runs between distinct buffers, so the ledger shows the model states on
// the host tiers. Pinned buffers that would pass the ledger's pinned-host
// limit fall back to pageable host memory with a warning.
//
// NOTE [offload transfers]
// Those copies run on the optimizer's CopyStream (NOTE [device streams]):
//   - gradients: at stages 2-3 each reduced chunk goes device-to-host as
//     its bucket's reduce-scatter ends, into one of two pinned staging
//     buffers, and the host adds it into the fp32 partition when the buffer
//     is needed again or when backward ends; at stage 1, whose gradients
//     stay on the device until the step, the next sub-group's gradient is
//     copied while CPU Adam steps the current one;
//   - parameters: CPU Adam writes each sub-group's new values, in the
//     compute dtype, into one of two pinned buffers, which goes
//     host-to-device while it steps the next sub-group. A buffer is written
//     again only after its copy has ended (the host waits for that copy,
//     never for the compute stream); the group's all-gather, and the next
//     forward, wait for the copies on the GPU.
// Stage 3 with offload_param writes the new values straight into the host
// shards, after the copies out of them have ended (NOTE [stage-3 gather
// stream]). On the CPU the same buffers and copies run, as memcpy.

/// Stage 3: the groups (group 0 first: the always-gathered parameters) and
/// the layers that use them.
struct Stage3Layout {
  std::vector<GroupSpec> groups;
  std::vector<Stage3Unit> units;
  Stage3Options options;
  /// offload_param.device = cpu: the partitions live in host memory (pinned
  /// when offload_param.pin_memory, within the ledger's pinned limit).
  bool offload_param = false;
  bool pin_param = true;
  /// offload_param.device = nvme (implies offload_param): the layer shards
  /// beyond max_in_cpu live in a swap file (NOTE [parameter swapping]).
  std::optional<ParamSwapOptions> nvme_param;
};

/// What one boundary step did.
struct StepOutcome {
  bool applied = false;   // false: skipped for non-finite gradients
  double grad_norm = 0;   // global L2 norm of the averaged, unscaled gradients
};

class ZeroOptimizer {
 public:
  /// Takes over `named_params` (rebinding them into a flat buffer) and creates
  /// the states of `optimizer` for the owned partition, all through `ledger`.
  /// `comm` may be null for one process; otherwise it must outlive this object.
  ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                std::unique_ptr<optim::FlatOptimizer> optimizer, ZeroOptimizerOptions options,
                MemoryLedger& ledger, Comm* comm);
  /// Stage 3 (options.stage must be 3).
  ZeroOptimizer(Stage3Layout layout, std::unique_ptr<optim::FlatOptimizer> optimizer, ZeroOptimizerOptions options,
                MemoryLedger& ledger, Comm* comm);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// Before a micro-step's backward; `boundary`: the last micro-step before step().
  void begin_backward(bool boundary);
  /// After backward returns: starts the collectives of groups that did not
  /// complete (parameters without gradients) and waits for them.
  void end_backward();

  /// One optimizer step from the accumulated gradients, which were produced
  /// by a loss multiplied by `loss_scale`. `clip` > 0 clips the global norm
  /// to it. Gradients are zeroed afterwards, applied or not. Throws
  /// zero::Error when gradients were produced outside begin/end_backward
  /// (a plain loss.backward()), which would skip reduction and scaling.
  StepOutcome step(const optim::StepParams& params, double loss_scale, double clip);

  /// Discards accumulated gradients.
  void zero_grad();

  /// Called by the gradient hook of slot `index` (see NOTE [gradient path]).
  void on_grad_ready(size_t index, const at::Tensor& grad);

  const FlatParameters& parameters() const { return *flat_; }
  int64_t num_parameters() const { return flat_->numel(); }
  /// L2 norm of all parameters (the compute-dtype values the model sees), in fp32.
  double parameter_l2() const;
  int stage() const { return options_.stage; }
  /// Seconds this rank waited for gradient reductions after backward (the
  /// part not hidden behind it), since construction.
  double grad_comm_wait_seconds() const { return comm_clock_.seconds(); }
  /// Seconds this rank waited for the all-gathers of parameters (stage 1-2:
  /// after the step; stage 3: also before each layer).
  double param_gather_wait_seconds() const;
  /// Seconds the host waited for device-host copies of the offloaded
  /// optimizer (NOTE [offload transfers]), since construction.
  double transfer_wait_seconds() const { return copy_wait_s_; }
  /// Stage 3's coordinator (null below stage 3).
  Stage3Coordinator* stage3() { return stage3_.get(); }
  const Stage3Coordinator* stage3() const { return stage3_.get(); }
  /// The NVMe swapper of the optimizer states (null unless options.nvme).
  const StateSwapper* swapper() const { return swapper_.get(); }
  /// The NVMe swapper of stage 3's parameter shards (null unless offload_param nvme).
  const ParamSwapper* param_swapper() const { return param_swapper_.get(); }

 private:
  bool partitioned() const { return options_.stage >= 1 && world_size_ > 1; }
  void init_states();
  void init_swapped_states();
  /// Stage 3: group g's shard, read from the parameter swap file when it is
  /// there, until shard_done(g).
  const at::Tensor& shard(size_t g) const;
  void shard_done(size_t g) const;
  void launch_ready_groups();
  void launch_group(size_t g);
  void finish_reduce_scatter(bool all);
  at::Tensor owned_grad_chunk(size_t g) const;
  at::Tensor master_chunk(size_t g) const;
  void wait_all();
  at::Tensor take_staging(size_t g);
  void release_staging(size_t g);
  void grad_to_host(size_t g, const at::Tensor& reduced, bool recycle);
  void add_host_grad();

  ZeroOptimizerOptions options_;
  std::unique_ptr<optim::FlatOptimizer> optimizer_;
  Comm* comm_;
  MemoryLedger& ledger_;
  int64_t world_size_ = 1;
  int64_t rank_ = 0;
  std::unique_ptr<FlatParameters> flat_;
  at::Tensor grads_;        // stage 0/1: flat, grad_accum_dtype, laid out like flat_
  at::Tensor owned_grads_;  // stage 2: owned partition, grad_accum_dtype
  at::Tensor master_;       // fp32 owned partition; stage 0 fp32: flat_; stage 3 fp32: undefined (the shards);
                            // NVMe: undefined (in swapper_)
  std::vector<at::Tensor> states_;  // NVMe: none (in swapper_)
  std::unique_ptr<StateSwapper> swapper_;
  struct SubGroup {
    size_t group;
    int64_t start, numel;  // within the group's chunk
  };
  std::vector<SubGroup> sub_groups_;  // the step's pieces, in order (sub_group_size)
  bool master_is_param_ = false;
  bool params_on_disk_ = false;  // stage 3, offload_param nvme: the shards cannot be the master

  // Per backward.
  bool in_backward_ = false;        // between begin_backward and end_backward
  bool outside_backward_ = false;   // a gradient arrived outside them (loss.backward())
  bool reducing_ = false;  // this backward's gradients are reduced (see NOTE)
  std::vector<int64_t> ready_;     // per group: parameters reported
  std::vector<at::Tensor> staging_;  // stage 2: per group, while in use
  std::vector<at::Tensor> spare_staging_;  // stage 2: released buckets kept for reuse (at most 2)
  size_t next_launch_ = 0;         // groups start in descending order from the last
  std::vector<CommWork> works_;    // stage 0/1 all-reduces in flight
  struct PendingScatter {
    size_t group;
    at::Tensor out;
    CommWork work;
  };
  std::deque<PendingScatter> scatters_;  // stage 2 reduce-scatters in flight
  CopyStream copies_;        // NOTE [offload transfers]
  WaitClock comm_clock_;     // waits for gradient reductions
  WaitClock gather_clock_;   // waits for the all-gathers after the step
  double copy_wait_s_ = 0;   // host waits for device-host copies
  HostRing grad_ring_;       // offload: gradients on their way to the host
  HostRing param_ring_;      // offload: new 16-bit values on their way to the device
  struct HostGrad {          // stage 2-3 offload: a reduced chunk copied to the host
    size_t group;
    at::Tensor host;
    StreamEvent done;
    at::Tensor recycle;      // the device staging it came from, reusable once done
  };
  std::deque<HostGrad> host_grads_;
  std::unique_ptr<ParamSwapper> param_swapper_;  // after flat_, before stage3_ (which uses it)
  std::shared_ptr<Stage3Coordinator> stage3_;     // after flat_: destroyed before it (autograd holds it weakly)
};

/// The compute dtype a config asks for: fp16, bf16 or fp32.
at::ScalarType compute_dtype(const config::Config& config);
/// The gradient accumulation dtype: data_types.grad_accum_dtype, else
/// DeepSpeed's default for the precision (fp16 -> fp16, bf16 -> fp32, fp32 -> fp32).
at::ScalarType grad_accum_dtype(const config::Config& config);

}  // namespace zero::partition
