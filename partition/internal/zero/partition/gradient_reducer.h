// Reducing gradients across ranks as backward produces them.
//
// NOTE [gradient path]
// Each trainable parameter has a post-accumulate-grad hook (ZeroOptimizer).
// When autograd has produced a parameter's gradient, the hook hands it to the
// reducer, which adds it into a flat buffer (in grad_accum_dtype) and frees
// the per-parameter gradient. When every parameter of a group (bucket, NOTE
// [flat layout]) has reported, the group's collective starts on the
// communication backend's threads while backward goes on; groups start in
// one fixed order on every rank (descending: backward produces the last
// layers' gradients first), so collectives match. Two reducers; the stage
// picks one (GradientReducer::create), and nothing else of the optimizer
// looks at the stage:
//   all-reduce (stages 0-1): full gradients accumulate over micro-steps in
//            one flat buffer; at the boundary micro-step each group is
//            all-reduced in place. Stage 0 (a layout of one partition) uses
//            every group whole; stage 1 uses this rank's chunk of each.
//   reduce-scatter (stages 2-3): no full gradient buffer: each group's
//            gradients land in a bucket that is reduce-scattered every
//            micro-step as soon as the group is complete (reduce_scatter
//            false: all-reduced, and this rank's chunk kept), and the rank's
//            chunk is added into the gradient partition of the state store
//            (NOTE [optimizer offload]: in host memory, through NOTE
//            [offload transfers]); at most two buckets are in flight, and
//            their buffers are reused (contiguous_gradients) or freed.
// Reductions sum. communication_data_type reduces a copy in that dtype and
// adds the result back in the accumulation dtype. Before the sum each bucket
// is multiplied by ReductionOptions::pre_scale (prescale_gradients: 1/N;
// gradient_predivide_factor f: 1/f, DeepSpeed's names); what remains of the
// average (N * pre_scale, or pre_scale alone with gradient_allreduce_op sum)
// joins the single unscale-and-clip factor of the step, so the divisions
// happen where DeepSpeed does them with one multiplication fewer.
//
// NOTE [16-bit gradients]
// At stage 3 with bf16 or fp16 compute, gradients stay in the compute dtype
// from autograd to the step, as DeepSpeed's stage 3 keeps them: buckets,
// reductions and the partition (data_types.grad_accum_dtype's default
// there; "fp32" keeps fp32 buckets and partitions, as below stage 3). So
// stage 3 holds 2 bytes a parameter of gradients where fp32 held 4 (16 a
// parameter of model states with fp32 Adam on one rank, not 18), and with
// optimizer offload the reduced chunks cross to the host in 16 bits, half
// the bytes, into a 16-bit partition there (an fp32 one below stage 3, as
// DeepSpeed's). The step widens them to fp32 only inside its window: on the
// CPU, 32K elements at a time in the core's cache, inside the CPU Adam
// pass, where the unscale multiplies too (optim::update_stored: the bits of
// g.to(fp32).mul_(1 / factor), memory reading 2 bytes an element once; an
// fp32 gradient is unscaled there too, where a pass of ATen's own took
// longer than Adam's); on a device, a piece of at most host_staging_numel
// elements. The norm's sum
// of squares widens a block at a time in cache too. Offloaded or not, the
// same values in the same dtype reach the same arithmetic: the tiers equal
// each other bit for bit. Against fp32 accumulation, a micro-step's single
// gradient on one rank is exact in 16 bits; sums over ranks and micro-steps
// round once per addition.
//
// Thread-safety: add() runs on autograd's thread during backward; the
// optimizer calls nothing else meanwhile.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/core/comm.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/host_ring.h"
#include "zero/partition/state_store.h"

namespace zero::partition {

struct ReductionOptions {
  at::Device device = at::kCPU;
  /// grad_accum_dtype: the buffers gradients accumulate in.
  at::ScalarType accum_dtype = at::kFloat;
  /// communication_data_type, when it differs from accum_dtype.
  std::optional<at::ScalarType> comm_dtype;
  /// Start collectives during backward while it goes on; false: all-reduce at
  /// the end of backward, reduce-scatter each complete bucket and wait for it.
  bool overlap_comm = true;
  /// Multiplies each bucket before the sum (see NOTE).
  double pre_scale = 1.0;
  /// Stages 2-3: false all-reduces each bucket instead (reduce_scatter: false).
  bool reduce_scatter = true;
  /// Stages 2-3: keep the bucket buffers for the next buckets
  /// (contiguous_gradients); false frees each once reduced.
  bool reuse_buckets = true;
  /// Offloaded optimizer: the reduced chunks go to the host through pinned
  /// buffers (stages 2-3).
  bool to_host = false;
  bool pin_memory = true;
  /// Elements of each pinned staging buffer (two): a reduced chunk larger
  /// goes to the host in pieces, so the buffers stay this size whatever the
  /// buckets (8M elements: 32 MiB in fp32).
  int64_t host_staging_numel = int64_t{1} << 23;
  /// zero_quantized_gradients (qgZ, stage 3 with more than one rank): each
  /// bucket is reduced in two quantized hops, within the node then across
  /// (NOTE [quantized gradients]), in blocks of `quant_block` elements.
  bool quantize_gradients = false;
  int64_t quant_block = 8000;
};

class GradientReducer {
 public:
  /// The reducer of `stage` (NOTE [gradient path]). `store` holds the
  /// gradient partition at stages 2-3; `comm` may be null (one process, or
  /// a partition of one rank); `copies` moves reduced chunks to the host.
  /// `replicas` (stages 2-3, may be null): the ranks holding this rank's
  /// partition too, across which the reduced chunks are summed as well
  /// (NOTE [MiCS]). All must outlive it.
  static std::unique_ptr<GradientReducer> create(int stage, FlatParameters& params, StateStore& store, Comm* comm,
                                                 MemoryLedger& ledger, CopyStream& copies, ReductionOptions options,
                                                 Comm* replicas = nullptr);
  virtual ~GradientReducer() = default;

  /// Before a micro-step's backward; `boundary`: the last one before a step.
  virtual void begin_backward(bool boundary) = 0;
  /// The gradient of slot `index` (a parameter), from its hook.
  virtual void add(size_t index, const at::Tensor& grad) = 0;
  /// After backward: starts the collectives of groups that did not complete
  /// (parameters without gradients) and waits for everything.
  virtual void end_backward() = 0;
  /// Waits for the collectives and copies in flight. Throws CommunicationError.
  virtual void wait_all() = 0;
  /// At step(), before the gradients are read: waits as wait_all, and
  /// finishes any reduction the window's micro-steps left (NOTE [MiCS]: the
  /// replicas' sum of a partition whose boundary ran no backward).
  virtual void before_step() { wait_all(); }
  /// This rank's reduced gradient of group g: the sum over ranks of its
  /// chunk, times pre_scale. On the device, or in host memory when the
  /// reduced chunks go to the host.
  virtual at::Tensor owned(size_t g) const = 0;
  /// Whether owned() lives in the state store (stages 2-3).
  virtual bool owned_in_store() const = 0;
  /// Discards accumulated gradients (waits for what is in flight first).
  virtual void zero() = 0;

  /// Called when the last piece of group g's reduced chunk has been added
  /// into the host partition (stages 2-3 offloaded, every micro-step; NOTE
  /// [speculative step]), on the thread that added it: autograd's (a
  /// gradient's add(), which first adds the pieces whose copies have ended,
  /// or a copy waiting for a buffer) or the caller of end_backward, wait_all
  /// or zero. It must not call back into the reducer.
  void set_on_host_final(std::function<void(size_t g)> fn) { on_host_final_ = std::move(fn); }

  /// Seconds waited for collectives (NOTE [device streams]: on a GPU, measured on the stream).
  double comm_wait_seconds() const { return clock_.seconds(); }
  /// Seconds the host waited for device-to-host copies of reduced chunks.
  double copy_wait_seconds() const { return copy_wait_s_; }

 protected:
  GradientReducer(FlatParameters& params, Comm* comm, MemoryLedger& ledger, CopyStream& copies,
                  ReductionOptions options);
  bool distributed() const { return comm_ != nullptr && comm_->world_size() > 1; }
  /// A group whose every parameter reported, or none left: launches the
  /// complete groups in descending order.
  void launch_ready();
  virtual void launch(size_t g) = 0;

  FlatParameters& params_;
  Comm* comm_;
  MemoryLedger& ledger_;
  CopyStream& copies_;
  ReductionOptions options_;
  bool reducing_ = false;      // this micro-step's gradients are reduced
  std::vector<int64_t> ready_;  // per group: parameters reported
  size_t next_launch_ = 0;     // groups launched, from the last
  WaitClock clock_;
  double copy_wait_s_ = 0;
  std::function<void(size_t g)> on_host_final_;
};

}  // namespace zero::partition
