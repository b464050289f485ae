// The ZeRO optimizer: owns the flat parameters, and through its parts the
// gradients (GradientReducer, NOTE [gradient path]) and the master (fp32 or
// 16-bit, NOTE [16-bit master]) and
// optimizer states (StateStore, NOTE [state store]); applies one optimizer
// step at each accumulation boundary, the same step loop for every stage and
// tier:
//   - the global gradient norm sums the owned gradients of all ranks, so
//     clipping and the fp16 overflow check (a non-finite norm) agree on every
//     rank; one factor unscales, averages and clips (DeepSpeed's
//     unscale_and_clip_grads);
//   - each sub-group of the owned partition is stepped by the optimizer,
//     which writes the new values in the compute dtype where the model reads
//     them: its own chunk (one partition), a buffer this rank's chunk is
//     all-gathered from (partitioned parameters below stage 3), or its shard
//     (stage 3), through pinned buffers when the states are offloaded (NOTE
//     [offload transfers]);
//   - stage 3 gathers each layer's parameters when it runs (NOTE [stage-3
//     layers]); only the always-gathered group is gathered again after the step.
//
// Thread-safety: hooks run on autograd's thread during backward; the Engine
// does not call anything else meanwhile.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/config/config.h"
#include "zero/optim/flat_optimizer.h"
#include "zero/core/comm.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/gradient_reducer.h"
#include "zero/partition/stage3.h"
#include "zero/partition/param_swapper.h"
#include "zero/partition/state_store.h"
#include "zero/partition/state_swapper.h"
#include "zero/partition/host_ring.h"

namespace zero::partition {

struct ZeroOptimizerOptions {
  int stage = 0;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType grad_accum_dtype = at::kFloat;
  /// The master's dtype (master_dtype(config)): fp32, or the compute dtype
  /// with bf16/fp16 master weights and grads (NOTE [16-bit master] in
  /// optim/), written back with stochastic rounding when `stochastic_rounding`.
  at::ScalarType master_dtype = at::kFloat;
  bool stochastic_rounding = true;
  at::Device device = at::kCPU;
  int64_t sub_group_size = 1000000000;
  /// Elements per group (bucket): reduce_bucket_size (stage 1/2 also bounded
  /// by allgather_bucket_size).
  int64_t bucket_numel = 500000000;
  /// How gradients are reduced (NOTE [gradient path]): overlap_comm,
  /// communication_data_type, the pre-scale, reduce_scatter,
  /// contiguous_gradients. Its device, dtype and offload fields are set from
  /// the fields here.
  ReductionOptions reduction;
  /// gradient_allreduce_op "mean" (true) divides the summed gradients by the
  /// world size; "sum" (false) does not.
  bool average_gradients = true;
  /// Skip the step when gradients are not finite (fp16 always; bf16 when
  /// bf16.check_grad_overflow).
  bool check_overflow = true;
  /// offload_optimizer.device = cpu (stages 1-3): the master, optimizer
  /// states and (stages 2-3) the gradient partition live in host memory
  /// and the optimizer runs on the CPU; see NOTE [optimizer offload].
  bool offload_optimizer = false;
  /// offload_optimizer.pin_memory: the host buffers are page-locked (the
  /// pinned-host tier), as far as the ledger's pinned limit allows.
  bool pin_memory = true;
  /// offload_optimizer.device = nvme: as offload_optimizer, but the fp32
  /// master and the optimizer states live in swap files and are stepped
  /// sub-group by sub-group (NOTE [optimizer swapping]); the gradient
  /// partition stays in host memory (on the device with grads_on_device).
  std::optional<SwapOptions> nvme;
  /// With nvme, offload_optimizer.max_in_cpu: elements of the offloaded
  /// groups whose master and states stay in host memory, the first ones
  /// (NOTE [state placement]).
  int64_t max_in_cpu = 0;
  /// offload_optimizer.ratio (stage 3, cpu or nvme): the share of the
  /// partition offloaded; the other groups' states, gradients and step stay
  /// on the device (NOTE [partial offload]).
  double offload_ratio = 1.0;
  /// offload_optimizer.gradients_on_device (stages 2-3): the gradient
  /// partition stays on the device (NOTE [device gradients]).
  bool grads_on_device = false;
  /// On the CPU: CopyMode::kDeferred makes every device-host transfer wait
  /// for its event (tests, NOTE [device streams]).
  CopyMode copy_mode = CopyMode::kImmediate;
  /// offload_optimizer.super_offload (stage 3 with CPU optimizer offload,
  /// no parameter offload): each sub-group's CPU step starts during the
  /// boundary backward, validated at step() (NOTE [speculative step]).
  bool super_offload = false;
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
//     its bucket's reduce-scatter ends, in pieces of at most
//     ReductionOptions::host_staging_numel elements, each into one of two
//     pinned staging buffers of that size, and the host adds a piece into
//     the host's partition (fp32, or 16-bit at stage 3: NOTE [16-bit
//     gradients]) as soon as its copy has ended, or when its buffer is
//     needed again, or when backward ends; at stage 1, whose gradients
//     stay on the device until the step (and at stages 2-3 with
//     gradients_on_device, NOTE [device gradients]), the gradient comes
//     to the host a piece of at most host_staging_numel elements at a
//     time, the next piece's copy running while CPU Adam steps this one
//     (GradFetch);
//   - parameters: CPU Adam writes each sub-group's new values, in the
//     compute dtype, a piece of at most host_staging_numel elements (a
//     multiple of 256, so 8-bit states' blocks are not cut) at a time, into
//     one of two pinned buffers of that size, which goes host-to-device
//     while it steps the next piece. A buffer is written
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

/// The step a boundary backward's speculation assumes (NOTE [speculative
/// step]): what step() will then be called with.
struct PlannedStep {
  optim::StepParams params;
  double loss_scale = 1.0;
  double clip = 0.0;
};

/// What one boundary step did.
struct StepOutcome {
  bool applied = false;   // false: skipped for non-finite gradients
  double grad_norm = 0;   // global L2 norm of the averaged, unscaled gradients
};

// NOTE [MiCS]
// mics_shard_size = S (stages 2-3) partitions the model states within
// groups of S consecutive ranks, the shard groups, and replicates them
// across the N / S groups: rank r holds partition r mod S, as do the other
// ranks of its replica group {r mod S, r mod S + S, ...}. The engine gives
// the ZeroOptimizer the shard group as its `comm` (none when S is 1) and
// the replica group as `replicas` (make_mics_groups); everything that
// partitions (the flat layout, the stores, the step's gathers, stage 3's
// shards and gathers, the gradient norm, which every replica computes
// alike) works on the shard group alone, while the average divides by all
// N ranks' gradients. A
// bucket is reduced in two hops: reduce-scattered within the shard group
// as ever, then summed across the replica group (GradientReducer):
//   - a gradient partition on the device accumulates the first hop's
//     chunks over the micro-steps, and the boundary micro-step all-reduces
//     each group's partition across the replicas as its chunk lands there
//     (DeepSpeed's MiCS does the same, at the boundary; a window whose
//     boundary ran no backward has its partitions summed at step());
//   - a chunk bound for host memory (optimizer offload) is all-reduced
//     across the replicas on the device before it goes down, every
//     micro-step: host memory is where NCCL cannot reach, and the CPU's
//     step (NOTE [speculative step] too) reads final gradients there.
//     DeepSpeed refuses MiCS with offload.
// The replica hop runs in the communication dtype when one is set, like
// the first. With S consecutive ranks a node (a launcher's usual
// placement), the partitions' gathers (stage 3's layers, stage 2's new
// values) and the first hop stay within the node; only the replica hop, a
// rank's chunk of each bucket, crosses nodes. A shard group spanning nodes
// can gather its layers in two hops instead (mics_hierarchical_params_gather,
// NOTE [hierarchical gather] in stage3.h). Sums are the same as a run of
// N ranks without MiCS up to the order of the additions (the bits equal
// where the order is: a shard group of the whole world, or replicas that
// saw the same data, whose sum doubles exactly). Checkpoints hold one
// replica's partitions, written by the ranks of the first shard group, at
// S partitions: they load at any other world size, MiCS or not (NOTE
// [checkpoint mapping]).
class ZeroOptimizer {
 public:
  /// Takes over `named_params` (rebinding them into a flat buffer) and creates
  /// the states of `optimizer` for the owned partition, all through `ledger`.
  /// `comm` may be null for one process; otherwise it must outlive this
  /// object. `replicas` (MiCS, NOTE [MiCS]; may be null): the ranks that
  /// hold this rank's partition too, with `comm` the ranks it is partitioned
  /// across (null when it is not); it must outlive this object.
  ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                std::unique_ptr<optim::FlatOptimizer> optimizer, ZeroOptimizerOptions options,
                MemoryLedger& ledger, Comm* comm, Comm* replicas = nullptr);
  /// Stage 3 (options.stage must be 3).
  ZeroOptimizer(Stage3Layout layout, std::unique_ptr<optim::FlatOptimizer> optimizer, ZeroOptimizerOptions options,
                MemoryLedger& ledger, Comm* comm, Comm* replicas = nullptr);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// Before a micro-step's backward; `boundary`: the last micro-step before
  /// step(). `planned` (a boundary's, with super_offload): the step() that
  /// follows, which the CPU steps assume while backward runs (NOTE
  /// [speculative step]); without it the step waits for step().
  void begin_backward(bool boundary, const std::optional<PlannedStep>& planned = std::nullopt);
  /// Whether begin_backward takes a planned step (super_offload in effect).
  bool speculates() const { return options_.super_offload; }
  /// What the speculation did since construction (NOTE [speculative step]).
  struct SpeculationCounts {
    int64_t planned = 0, validated = 0, redone = 0, undone = 0;
    int64_t sub_groups = 0;  // sub-group steps taken ahead (any thread may read it, during backward too)
  };
  /// Bytes of the speculative step's undo copy (host memory; 0 without super_offload).
  int64_t speculation_undo_bytes() const;
  SpeculationCounts speculation_counts() const {
    SpeculationCounts c = spec_counts_;
    c.sub_groups = spec_sub_groups_.load();
    return c;
  }
  /// After backward returns: starts the collectives of groups that did not
  /// complete (parameters without gradients) and waits for them.
  void end_backward();

  /// One optimizer step from the accumulated gradients, which are `loss_scale`
  /// times the loss's (the factor the step divides by before clipping and
  /// updating). `clip` > 0 clips the global norm to it. Gradients are zeroed
  /// afterwards, applied or not.
  StepOutcome step(const optim::StepParams& params, double loss_scale, double clip);

  /// Called when a gradient arrives outside begin/end_backward (a backward
  /// the program started itself: loss.backward(), out.backward(grad), another
  /// engine's backward): it must call begin_backward, and arrange for
  /// end_backward when autograd's pass ends (NOTE [user backward]). Without
  /// it, such a gradient is an internal error.
  void set_on_user_backward(std::function<void()> fn) { on_user_backward_ = std::move(fn); }

  /// Discards accumulated gradients.
  void zero_grad();
  /// After a backward that ended in an error (end_backward never ran):
  /// waits for the reductions it launched, ends stage 3's backward, and
  /// discards every gradient, so the next backward starts clean.
  void abandon_backward();
  bool in_backward() const { return in_backward_; }

  /// A parameter group's hyper-parameters: its lr (the schedule's lr times
  /// lr / the optimizer's lr, so a schedule applies to every group) and
  /// weight decay; none: the optimizer's own.
  struct GroupHyper {
    std::string name;
    std::optional<double> lr, weight_decay;
    /// Engine::set_lr's: the lr itself (not scaled by the schedule) until
    /// the engine clears it at the schedule's next step.
    std::optional<double> lr_set;
  };
  /// Parameter groups (DeepSpeed's client param groups): group_of[i] is
  /// the index in `groups` of slot i's group (0: the default, the
  /// optimizer's values). Each step then updates the runs of elements of
  /// one group with its hyper-parameters (padding goes with group 0).
  void set_param_groups(std::vector<GroupHyper> groups, const std::vector<size_t>& group_of);
  const std::vector<GroupHyper>& param_groups() const { return groups_; }
  /// Replaces group g's hyper-parameters (a checkpoint's, Engine::set_lr's);
  /// a speculation in progress is settled first (NOTE [speculative step]:
  /// its worker reads them).
  void set_group_hyper(size_t g, const GroupHyper& h) {
    spec_settle();
    groups_.at(g) = h;
  }
  /// The optimizer's own hyper-parameters (the default group's).
  const config::OptimizerConfig& optimizer_config() const { return optimizer_->config(); }
  /// Elements of each group in the model (padding not counted).
  std::vector<int64_t> param_group_numels() const;

  /// Sub-group k's master and states (m, s), and where its new values go in
  /// the compute dtype (null when the master is the parameters); see write_pass.
  using PassBody = std::function<void(size_t k, at::Tensor& m, std::vector<at::Tensor>& s, at::Tensor* low)>;
  /// Visits the store's sub-groups (store().sub_groups()) without changing
  /// them (engine checkpoints read the states from where they live). Throws
  /// IoError (NVMe).
  void read_states(const StateStore::Visit& fn);
  /// Sets every sub-group's master and states with `fill` (which must write
  /// all of m and s; its `low` is null), then brings the model's parameters
  /// to the masters' values, gathered as after a step. Discards gradients.
  /// Throws what `fill` throws, IoError, CommunicationError.
  void load_states(const PassBody& fill);

  /// New values for elements of this rank's chunk of a trainable group:
  /// `values` holds the chunk (parameters().groups()[g].chunk_numel
  /// elements, any float dtype); only the elements `mask` (bool, as long)
  /// marks are taken.
  struct ChunkUpdate {
    at::Tensor values, mask;
  };
  /// Sets the master where `chunks` says (by group), then brings the
  /// parameters to the masters' values as a step does (the states stay;
  /// every other element keeps its master). A collective below stage 3
  /// (the new values are all-gathered). Throws IoError (NVMe),
  /// CommunicationError.
  void set_values(const std::map<size_t, ChunkUpdate>& chunks);
  /// Stage 3: sets frozen group g's shard (NOTE [frozen groups]; g indexes
  /// parameters().all_groups()) to `values`, this rank's chunk of the
  /// group (chunk_numel elements, any float dtype and device), in the
  /// shard's memory or through the parameter swap file. The next gather of
  /// the layer brings the new values. Throws IoError (the swap file).
  void write_frozen_shard(size_t g, const at::Tensor& values);

  /// Called by the gradient hook of slot `index` (see NOTE [gradient path]).
  void on_grad_ready(size_t index, const at::Tensor& grad);

  const FlatParameters& parameters() const { return *flat_; }
  /// The partition this rank holds (its rank in the partition's group;
  /// 0 when there is one partition).
  int64_t partition_rank() const { return flat_->world_size() == 1 ? 0 : rank_; }
  int64_t num_parameters() const { return flat_->numel(); }
  /// L2 norm of all parameters (the compute-dtype values the model sees), in fp32.
  double parameter_l2() const;
  /// Seconds this rank waited for gradient reductions after backward (the
  /// part not hidden behind it), since construction.
  double grad_comm_wait_seconds() const { return reducer_->comm_wait_seconds(); }
  /// Seconds this rank waited for the all-gathers of parameters (stage 1-2:
  /// after the step; stage 3: also before each layer).
  double param_gather_wait_seconds() const;
  /// Seconds the host waited for device-host copies of the offloaded
  /// optimizer (NOTE [offload transfers]), since construction.
  double transfer_wait_seconds() const { return copy_wait_s_ + reducer_->copy_wait_seconds(); }
  /// Bytes the offloaded optimizer moved between the device and host memory
  /// (reduced gradients down, new values up; NOTE [offload transfers]),
  /// since construction. Read it outside backward (the speculative worker's
  /// copies count too).
  int64_t transfer_bytes() const { return copies_.bytes_copied() + (spec_ ? spec_->copies.bytes_copied() : 0); }
  /// Stage 3's coordinator (null below stage 3).
  Stage3Coordinator* stage3() { return stage3_.get(); }
  const Stage3Coordinator* stage3() const { return stage3_.get(); }
  /// The master and optimizer states.
  const StateStore& store() const { return *store_; }
  /// The NVMe swapper of the optimizer states (null unless options.nvme).
  const StateSwapper* swapper() const { return store_->swapper(); }
  /// The NVMe swapper of stage 3's parameter shards (null unless offload_param nvme).
  const ParamSwapper* param_swapper() const { return param_swapper_.get(); }
  /// Test seam: the gradient reducer.
  const GradientReducer& reducer() const { return *reducer_; }

 private:
  void init(Stage3Layout* layout);
  /// Where a write pass's body puts sub-group k's new values in the compute
  /// dtype (see write_pass): a piece [start, start + len) at a time, of at
  /// most max_piece() elements (a multiple of 256, the 8-bit states' block),
  /// done() after each piece is written.
  class LowOut {
   public:
    bool wanted() const { return mode_ != Mode::kNone; }
    int64_t max_piece() const { return max_piece_; }
    at::Tensor piece(int64_t start, int64_t len);
    void done();

   private:
    friend class ZeroOptimizer;
    enum class Mode { kNone, kInPlace, kToDevice };
    Mode mode_ = Mode::kNone;
    HostRing* ring_ = nullptr;        // kToDevice: the pinned buffers, the stream and
    CopyStream* copies_ = nullptr;    // the wait counter it goes through
    double* wait_s_ = nullptr;
    at::Tensor out_;  // the sub-group's destination (its range of the group's output)
    int64_t max_piece_ = 0, start_ = 0, len_ = 0;
    at::Tensor host_;  // kToDevice: the ring buffer of the piece being written
    StreamEvent* last_ = nullptr;
    StreamEvent* group_last_ = nullptr;
  };
  using WriteBody = std::function<void(size_t k, at::Tensor& m, std::vector<at::Tensor>& s, LowOut& low)>;
  /// `device_only`: the groups on the device alone (NOTE [partial offload];
  /// after a validated speculation, which stepped the host's).
  void write_pass(const WriteBody& body, bool device_only = false);
  /// Elements of a piece of new values on their way to the device: at most
  /// host_staging_numel, a multiple of 256 (8-bit blocks; NOTE [offload transfers]).
  int64_t value_piece() const;
  /// Two pinned buffers of a piece of new values (at most the largest
  /// sub-group), in the compute dtype.
  HostRing make_value_ring(const std::string& what);
  /// A LowOut sending `out`'s new values to the device through `ring` on
  /// `copies` (the host's waits added to `wait_s`), each copy's end into
  /// `last` and `group_last`.
  static LowOut to_device(const at::Tensor& out, int64_t piece, HostRing& ring, CopyStream& copies, double& wait_s,
                          StreamEvent& last, StreamEvent& group_last);
  /// Writes master m's values through `low`, as a load does (a parameter is
  /// its master in the compute dtype).
  static void write_values_of(const at::Tensor& m, LowOut& low);
  /// Gradients that stay on the device while their states are on the host
  /// (stage 1's; a partition kept there with gradients_on_device) come to
  /// the host a piece of value_piece() elements at a time, in the order the
  /// step takes them, through two pinned buffers, the next piece's copy
  /// running while the CPU steps this one (NOTE [offload transfers]).
  class GradFetch {
   public:
    GradFetch(HostRing& ring, CopyStream& copies, double& wait_s) : ring_(ring), copies_(copies), wait_s_(wait_s) {}
    /// Elements [a, a + n) of `grad` (sub-group k's, on the device) will be taken, in this order.
    void plan(size_t k, int64_t a, int64_t n, const at::Tensor& grad) { order_.push_back({k, a, n, grad}); }
    /// Piece [a, a + n) of sub-group k, in host memory once its copy has
    /// ended; valid until the next take() (which copies into its buffer).
    at::Tensor take(size_t k, int64_t a, int64_t n);

   private:
    struct Piece {
      size_t k;
      int64_t a, n;
      at::Tensor src;
    };
    HostRing& ring_;
    CopyStream& copies_;
    double& wait_s_;
    std::vector<Piece> order_;
    size_t next_ = 0;
    std::deque<std::pair<at::Tensor, StreamEvent>> ahead_;  // pieces on their way, in order
  };
  /// Whether group g's gradient is on the device while its states step on
  /// the host: fetched through GradFetch.
  bool grad_fetched(size_t g) const;
  /// The optimizer's update of sub-group k from its gradient `grad` (in its
  /// dtype; with `fetch`, on the device and taken from it a piece at a
  /// time), unscaled and clipped by dividing by `combined`, new values
  /// through `low`. A gradient in host memory stepped on the CPU is left as
  /// it was (one on the step's device is unscaled in place). `undo` (the master, then the states, shaped as m and s): receives them
  /// as they were, a window at a time just before its update; `undo_saved`
  /// then says how many elements from the first it holds (0 once the side
  /// states are in).
  void step_sub_group(size_t k, const at::Tensor& grad, at::Tensor& m, std::vector<at::Tensor>& s, LowOut& low,
                      const optim::StepParams& params, double combined,
                      const std::vector<at::Tensor>* undo = nullptr, int64_t* undo_saved = nullptr,
                      GradFetch* fetch = nullptr);
  /// Σ x² of group g's owned gradient, in fp64 (NOTE [gradient norm]).
  at::Tensor group_sum_of_squares(size_t g) const;

  // NOTE [speculative step] (super_offload.cpp).
  void spec_init(const Stage3Layout* layout);  // checks the setup, starts the worker
  void spec_group_final(size_t g);   // the reducer: group g's host gradient is final
  void spec_worker();
  void spec_wait();                  // until the worker has stepped every group; rethrows its error
  void spec_restore(bool rewrite_values);  // undoes the sub-groups stepped
  void spec_cancel();                // an abandoned backward: undo, values too
  void spec_settle();                // outside backward, before the shards or states are read: cancel
  void spec_rewrite_values();        // the stepped sub-groups' shards from their masters
  struct Speculation {
    std::thread worker;
    std::mutex mu;
    std::condition_variable cv;
    bool armed = false, stop = false;
    std::deque<size_t> ready;        // groups whose gradients are final, in order
    size_t notified = 0;             // groups made final this backward
    size_t groups_done = 0;          // of them, stepped by the worker (or skipped)
    bool skip = false;               // after an error or a cancel: the rest are not stepped
    std::exception_ptr error;
    PlannedStep plan;
    double combined = 1.0;           // the factor assumed: no clipping
    std::vector<at::Tensor> sumsq;   // per group
    std::vector<char> stepped;       // per sub-group
    std::vector<int64_t> saved;      // per sub-group: elements in the undo copy (-1: none)
    CopyStream copies;               // the worker's transfers (a stream is one thread's)
    HostRing ring;
    double wait_s = 0;
    StreamEvent last;                // the worker's last copy of new values
    at::Tensor undo;                 // master and states as they were, per sub-group:
    std::vector<std::vector<at::Tensor>> undo_views;  // views of `undo`
    explicit Speculation(at::Device device, CopyMode mode) : copies(device, mode) {}
  };
  std::unique_ptr<Speculation> spec_;
  SpeculationCounts spec_counts_;
  std::atomic<int64_t> spec_sub_groups_{0};
  /// Stage 3: group g's shard, read from the parameter swap file when it is
  /// there, until shard_done(g).
  const at::Tensor& shard(size_t g) const;
  void shard_done(size_t g) const;
  /// Several ranks hold parts of the optimizer states (stages 1-3).
  bool partitioned() const { return flat_->world_size() > 1; }

  ZeroOptimizerOptions options_;
  std::unique_ptr<optim::FlatOptimizer> optimizer_;
  Comm* comm_;
  Comm* replicas_;  // NOTE [MiCS]
  MemoryLedger& ledger_;
  int64_t world_size_ = 1;  // the ranks of a partition (comm_'s)
  int64_t rank_ = 0;
  int64_t grad_ranks_ = 1;  // the ranks whose gradients are summed: world_size_ times the replicas'
  /// What remains of the average after the reductions' pre-scale (NOTE [gradient path]).
  double average_factor() const {
    return (options_.average_gradients ? static_cast<double>(grad_ranks_) : 1.0) * options_.reduction.pre_scale;
  }
  std::unique_ptr<FlatParameters> flat_;
  CopyStream copies_;        // NOTE [offload transfers]
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<GradientReducer> reducer_;
  WaitClock gather_clock_;   // waits for the all-gathers after the step
  double copy_wait_s_ = 0;   // host waits for device-host copies of the step
  HostRing grad_ring_;       // gradients on the device on their way to the host (GradFetch)
  HostRing param_ring_;      // offload: new 16-bit values on their way to the device

  // Parameter groups: by sub-group, its runs of one group (start within
  // the sub-group, length, group); empty without groups.
  struct Run {
    int64_t start, numel;
    size_t group;
  };
  std::vector<GroupHyper> groups_;
  std::vector<size_t> group_of_;             // by slot
  std::vector<std::vector<Run>> runs_;       // by sub-group
  double base_lr_ = 0;                       // the optimizer's lr, which groups' lrs scale

  // Per backward.
  bool in_backward_ = false;        // between begin_backward and end_backward
  std::function<void()> on_user_backward_;
  std::unique_ptr<ParamSwapper> param_swapper_;  // after flat_, before stage3_ (which uses it)
  std::shared_ptr<Stage3Coordinator> stage3_;     // after flat_: destroyed before it (autograd holds it weakly)
};

/// NOTE [MiCS]: the groups a ZeroOptimizer partitions and replicates over.
/// `partition` is what it takes as its comm, `replicas` as its replicas.
struct MicsGroups {
  std::unique_ptr<Comm> shard, replica_group;  // owned here (none when not needed)
  Comm* partition = nullptr;                   // the shard group; the world itself, or none for one rank
  Comm* replicas = nullptr;                    // the replica group; none without replicas
};
/// This rank's groups for shard groups of `shard` consecutive ranks of
/// `world` (which must divide its size): a shard group of one rank has no
/// Comm, and a shard of the whole world is `world` with no replicas. Every
/// rank calls it at the same point (Comm::subgroup). Throws
/// CommunicationError when a group cannot be made.
MicsGroups make_mics_groups(Comm& world, int64_t shard);

/// The compute dtype a config asks for: fp16, bf16 or fp32.
at::ScalarType compute_dtype(const config::Config& config);
/// The gradient accumulation dtype: data_types.grad_accum_dtype, else
/// DeepSpeed's default for the precision and stage (fp16 -> fp16; bf16 ->
/// fp32 at stages 0-2, bf16 at stage 3 and with a bf16 master, NOTE [16-bit
/// gradients]; fp32 -> fp32).
at::ScalarType grad_accum_dtype(const config::Config& config);
/// The master's dtype: bf16 with bf16.enabled and bf16_master_weights_and_grads,
/// fp16 with fp16.enabled and fp16_master_weights_and_grads (stages 1-3), else fp32.
at::ScalarType master_dtype(const config::Config& config);
/// communication_data_type, when set: the dtype reductions run in. Unset,
/// they run in the accumulation dtype (DeepSpeed's default is the compute
/// dtype; this keeps bf16 reductions in fp32 at stages 0-2).
std::optional<at::ScalarType> communication_dtype(const config::Config& config);

}  // namespace zero::partition
