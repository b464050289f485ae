// Stage 3's parameter coordinator: gathers each layer's parameters before it
// runs (forward and backward) and releases them after, with prefetch.
//
// NOTE [stage-3 layers]
// LibTorch modules have no forward hooks, so stage 3 works on layers: modules
// whose forward runs through zero::layer_forward (zero/partition/layer.h); the
// engine routes the entries of a Sequential there itself. A layer knows its
// coordinator through a child module the coordinator adds to it, named
// `_zero_stage3_layer` (no parameters, no buffers), and takes away when it
// goes: there is no process-wide table, and a module that is a layer of one
// live engine cannot become one of another. The autograd nodes on a layer's
// boundary hold the coordinator weakly: backward through a graph whose engine
// is gone fails with a UsageError instead of reaching freed memory. Parameters are in
// groups (NOTE [flat layout], one group per layer, NOTE [stage-3 storage]);
// a layer needs its own group and the groups of any tied parameter it shares
// with another layer. Group 0 holds the parameters outside every layer and
// those under stage3_param_persistence_threshold: it is always gathered.
//
// Events: pre_forward / post_forward around the layer's forward; pre_backward
// when the gradient reaches the layer's outputs (an identity autograd Function
// on them) and post_backward when it has gone through to its inputs (the same
// on its inputs). A layer whose inputs need no gradient (the first) is
// released by end_backward().
//
// NOTE [stage-3 trace]
// The events of one micro-step (forward then backward) form the trace. The
// first micro-step records it; later ones follow it and, at each event, issue
// the all-gathers of the next layers in the trace ahead of time while fewer
// than stage3_prefetch_bucket_size elements are in flight (the last one may
// pass it by up to a layer), never past
// stage3_max_live_parameters gathered. After a layer runs, its groups stay
// gathered when the trace uses them again within stage3_max_reuse_distance
// elements of other gathers; otherwise they are released. An event that does
// not match the trace invalidates it: no prefetch or reuse until the
// micro-step ends, and that micro-step's events become the new trace. Every
// decision depends on the events only, never on timing, so ranks that run the
// same layers issue the same collectives in the same order. Each all-gather
// is paired with an exchange of the group's id on a separate small-message
// group (Comm::start_exchange), started when the gather is issued:
// ranks whose gathers no longer pair up (they run different layers) fail
// naming both layers, instead of hanging, using the wrong shards, or
// aborting inside the backend on collectives of different sizes. Where
// ranks may disagree the check finishes before the collective is launched:
// a gather issued while the trace is not trusted (the first micro-step,
// and from a rank's first event off the trace), outside training (a
// no_grad forward is not traced), or exact (with_gathered, hold). A
// gather that follows the trusted trace is launched at once and checked
// before its values are used, as before: every rank recorded the same
// trace in a first micro-step whose gathers were all checked, so ranks
// that part ways part from the trace, and the one that leaves it checks
// before it launches anything of its own (it fails there, and the others
// fail at their next wait). On the trusted path the check costs nothing
// before the launch; with NCCL it is a host wait per gather before the
// values are used (bounded by the prefetch window when prefetched). Ranks
// that legitimately run different parts of a module make it a leaf (NOTE
// [leaf modules]).
//
// NOTE [stage-3 gather stream]
// A gather runs on the coordinator's CopyStream (NOTE [device streams]),
// after the work the compute stream has queued so far: with offload_param,
// the shard goes host-to-device there (into the full tensor on one rank,
// else into a device buffer the all-gather sends), and the all-gather is
// launched with that stream current, so NCCL starts once the copy is done
// and neither waits for compute queued later. Prefetched gathers thus run
// beside the layers before them. Waiting for a gather makes the compute
// stream wait for it (the host waits only where the backend blocks, Gloo),
// and the time the training thread stands still there is measured on the
// stream (WaitClock). The host memory a shard was copied out of (a
// parameter swap buffer, or the offloaded partition) is written again only
// after that copy has ended: the swapper gets the copy's event with
// release(), and the optimizer step waits for it before writing a shard
// (wait_shard_copies).
//
// NOTE [hpZ]
// ZeRO++'s hierarchical partitioning (zero_hpz_partition_size = k): ranks
// form groups of k consecutive ranks (a node's, under the launchers zero
// reads) with a Comm of their own (Comm::subgroup). The first gather of a
// layer after the parameters changed (an optimizer step, a load) is the
// world's; it leaves this rank's k-th of the gathered tensor in the group's
// secondary partition. Every later gather of that layer, backward's above
// all, all-gathers the secondary partition within the group: the same
// values (qwZ's, when the first gather was quantized; an exact gather,
// with_gathered, does not take those), so backward computes with what
// forward did, and the bits equal a run without hpZ whenever qwZ is off. The
// secondary partitions cost 1/k of the layers' gathered bytes in the compute
// dtype, on the device, from a layer's first training gather after a step
// (a gather under no_grad, evaluation's or saving's, leaves none) until the
// next step (the ledger: "hpZ secondary partition"; the estimator counts
// them at the peak). Under qwZ an exact gather leaves no copy either, so a
// run that saves trains as one that does not; read_ahead reads no shard from disk for a
// layer whose next gather is from the copy.
// Every rank decides which gather it takes from the same events, so the
// collectives pair up. DeepSpeed keeps its secondary quantized under qwZ;
// zero keeps the decoded values, so within the node nothing is quantized twice.
//
// NOTE [hierarchical gather]
// mics_hierarchical_params_gather (NOTE [MiCS]): when the coordinator's
// ranks (a MiCS shard group, or the world) sit on M nodes of L consecutive
// ranks each, a layer's gather goes in two hops. First across the nodes,
// among the M ranks of one local index l: each sends its shard once, and
// receives the shards r = jL + l of the other nodes into a staging buffer of
// M shards ("hierarchical gather's shards from the other nodes", a comm
// buffer of the ledger, held until the gather is waited for). Then within
// the node, M all-gathers of L shards each, block j from staged shard j,
// straight into the gathered tensor, in rank order (no copy to reorder).
// Each rank sends M - 1 shards across nodes, every rank alike, where a
// ring over all S = M L ranks sends S - 1 from the one rank at each node's
// edge and none from the others: the shards leaving a node fall from S - 1
// to S - L, and the busiest rank's from S - 1 to M - 1, the load spread
// over the node's ranks (and their links). The values are the shards' (or qwZ's
// payloads, gathered the same way), so the bits equal a flat gather's. The
// first hop is waited for where the second is launched, on the gather
// stream: on a GPU the stream waits and the host goes on, while Gloo's
// wait blocks the training thread for the first hop (a prefetch, too), and
// the exchange of layer ids (NOTE [stage-3 trace]) is finished before it.
// Other placements (a shard group on one node, one rank a node, nodes of
// unequal rank counts, ranks not in node order) gather flat, with a note in
// the log.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "zero/core/comm.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/streams.h"
#include "zero/core/trace.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/param_swapper.h"
#include "zero/partition/quantized_gather.h"
#include "zero/partition/ungathered_use.h"

namespace zero::partition {

struct Stage3Options {
  int64_t prefetch_bucket_numel = 50000000;  // stage3_prefetch_bucket_size
  int64_t max_live_numel = 1000000000;       // stage3_max_live_parameters
  int64_t max_reuse_distance = 1000000000;   // stage3_max_reuse_distance
  /// offload_param: the shards live in host memory (or on disk); a gather
  /// first copies the shard to the device (NOTE [stage-3 gather stream]).
  bool shards_offloaded = false;
  /// On the CPU: CopyMode::kDeferred makes the shard copies wait for their
  /// events (tests, NOTE [device streams]).
  CopyMode copy_mode = CopyMode::kImmediate;
  /// zero_quantized_weights (qwZ): layers' gathers send block-quantized int8
  /// weights of `quant_block` elements a scale (NOTE [quantized gather]).
  bool quantize_weights = false;
  int64_t quant_block = kDefaultQuantBlock;
  /// zero_hpz_partition_size (hpZ): groups of this many consecutive ranks
  /// keep a secondary partition of each layer gathered (NOTE [hpZ]).
  int64_t hpz_partition_size = 1;
  /// mics_hierarchical_params_gather: layers' gathers cross the nodes first,
  /// a shard a rank, then go within each node (NOTE [hierarchical gather]).
  bool hierarchical_gather = false;
};

/// One layer: a module whose forward runs through zero::layer_forward.
struct Stage3Unit {
  std::string name;  // its name in the model ("blocks.3")
  std::shared_ptr<torch::nn::Module> module;
  std::vector<size_t> groups;  // groups its parameters live in (never group 0)
  /// A leaf module (NOTE [leaf modules]): every trainable parameter of it
  /// gets a gradient each backward (zeros where it did not run).
  bool leaf = false;
};

class Stage3Coordinator : public std::enable_shared_from_this<Stage3Coordinator> {
 public:
  /// Gathers group 0 and marks every unit's module as a layer of this
  /// coordinator (NOTE [stage-3 layers]) until it is destroyed. `swapper`
  /// (may be null, else outlives this): offload_param nvme, NOTE [parameter
  /// swapping]; shards on disk are read for their gathers. Throws UsageError
  /// when a module is already a layer of another live engine.
  static std::shared_ptr<Stage3Coordinator> create(FlatParameters& params, std::vector<Stage3Unit> units,
                                                   Stage3Options options, at::Device device, Comm* comm,
                                                   MemoryLedger& ledger, ParamSwapper* swapper = nullptr);
  /// Takes the marks off the modules.
  ~Stage3Coordinator();
  Stage3Coordinator(const Stage3Coordinator&) = delete;
  Stage3Coordinator& operator=(const Stage3Coordinator&) = delete;
  Stage3Coordinator(FlatParameters& params, std::vector<Stage3Unit> units, Stage3Options options,
                    at::Device device, Comm* comm, MemoryLedger& ledger, ParamSwapper* swapper);

  void pre_forward(size_t unit);
  void post_forward(size_t unit);
  void pre_backward(size_t unit);
  void post_backward(size_t unit);
  /// After autograd's backward: releases every layer and closes the micro-step's trace.
  void end_backward();
  /// After an optimizer step changed the partitions: refreshes group 0.
  void after_step();
  /// Waits for one all-gather in flight (the swapper needs its buffer);
  /// false when none is in flight.
  bool finish_a_gather();
  /// Gathers group g (on every rank), runs fn, and releases it unless in use.
  void with_gathered(size_t g, const std::function<void()>& fn);
  /// The two halves of with_gathered, for a scope that spans calls
  /// (zero::GatheredParameters): hold() gathers group g exactly (on every
  /// rank) and keeps it; it returns whether it was released before, which
  /// unhold() takes to release it again.
  bool hold(size_t g);
  void unhold(size_t g, bool was_released);
  /// The host waits until no copy out of group g's shard (in host memory) is
  /// in flight: the optimizer step is about to write it.
  void wait_shard_copies(size_t g);
  /// Group g's shard is about to be written outside a step (a load of a
  /// frozen group, NOTE [frozen groups]): waits for copies out of it, and
  /// drops what was gathered from it (its gathered values unless a running
  /// layer uses them, its hpZ copy).
  void shards_changed(size_t g);
  /// Called before a gather reads a group's shard (NOTE [speculative step]:
  /// a speculation that shards hold is settled first). Runs on the thread
  /// that gathers; must not gather itself.
  void set_before_gather(std::function<void()> fn) { before_gather_ = std::move(fn); }

  const std::vector<Stage3Unit>& units() const { return units_; }
  /// hpZ: bytes of the secondary partitions held now.
  int64_t secondary_bytes() const;
  /// Elements gathered now in layer groups (group 0 not counted), and the peak.
  int64_t live_numel() const { return live_; }
  int64_t peak_live_numel() const { return peak_live_; }
  void reset_peak_live() { peak_live_ = live_; }
  /// Seconds the training thread waited for all-gathers (and for shards
  /// coming from disk), measured on the stream on a GPU (NOTE [stage-3 gather stream]).
  double gather_wait_seconds() const { return clock_.seconds() + read_wait_s_; }
  int64_t gathers() const { return gathers_; }
  int64_t prefetched_gathers() const { return prefetched_; }
  bool trace_valid() const { return trusted_; }
  /// offload_param: the shards are in host memory (or on disk).
  bool shards_offloaded() const { return options_.shards_offloaded; }

 private:
  enum class State { kReleased, kInFlight, kGathered };
  struct Group {
    State state = State::kReleased;
    int users = 0;          // layers running now that need it
    bool guarded = true;    // parameters rebound to empty tensors
    bool prefetched = false;
    bool launched = false;  // in flight: its collective started (else queued, NOTE [parameter swapping])
    CommWork work;
    Comm::Exchange check;  // the group ids all ranks gather with it
    at::Tensor send;
    bool quantized = false;       // the gather in flight (or done) is qwZ's
    bool from_secondary = false;  // the gather in flight is hpZ's, within the node
    bool check_first = false;     // its layer-id check finishes before it is launched (NOTE [stage-3 trace])
    at::Tensor received;          // qwZ: the payloads gathered, until decoded
    LedgerReservation buffer_bytes;  // qwZ: its payloads in flight
    at::Tensor secondary;         // hpZ: this rank's part of the node's copy
    bool secondary_quantized = false;  // ... of qwZ's values
    LedgerReservation secondary_bytes;
    std::vector<CommWork> hops;   // NOTE [hierarchical gather]: the within-node gathers
    at::Tensor staged;            // ... and the other nodes' shards they send
    StreamEvent done;        // the end of the gather's work on the gather stream
    StreamEvent shard_copy;  // the end of the last copy out of the host shard
    LedgerReservation bytes;
  };
  struct Event {
    size_t unit;
    bool backward;
    bool operator==(const Event& o) const { return unit == o.unit && backward == o.backward; }
  };

  bool traced(const Event& e) const;
  std::string describe(int64_t g) const;
  void on_event(Event e);
  void acquire(size_t unit, bool traced);
  void issue(size_t g, bool prefetch, bool exact = false);
  void launch_queued(std::optional<size_t> until);
  void launch(size_t g);
  void launch_collective(size_t g, const at::Tensor& chunk, bool from_host);
  /// All-gathers `in` (a shard, or qwZ's payload) into `out` over the
  /// coordinator's ranks: one collective into grp.work, or the two hops of
  /// NOTE [hierarchical gather].
  void all_gather(size_t g, at::Tensor& out, const at::Tensor& in);
  /// Finishes group g's exchange of ids; throws CommunicationError when the
  /// ranks gather different groups (NOTE [stage-3 trace]).
  void check_pairing(size_t g);
  /// NOTE [hierarchical gather]: the groups of the two hops, when the ranks'
  /// nodes allow them.
  void make_hierarchy();
  void keep_secondary(size_t g);
  void drop_secondary(size_t g);
  void drop_secondaries();
  void wait(size_t g);
  void finish(size_t g);
  void bind(size_t g);
  void guard(size_t g);
  void release(size_t g);
  void maybe_release(size_t g, bool traced);
  void make_room(int64_t numel);
  void prefetch();
  void read_ahead();
  /// Elements gathered by the trace after the cursor before group g is used
  /// again; -1 when it is not.
  int64_t next_use_distance(size_t g) const;
  int64_t numel(size_t g) const { return params_.all_groups()[g].padded_numel; }
  Kind kind_of(size_t g) const {
    return params_.all_groups()[g].frozen ? Kind::kFrozenParameters : Kind::kParameters;
  }

  FlatParameters& params_;
  std::vector<Stage3Unit> units_;
  std::vector<trace::OpenSpan> forward_span_, backward_span_;  // per unit (NOTE [trace])
  Stage3Options options_;
  at::Device device_;
  Comm* comm_;
  std::unique_ptr<Comm> hpz_comm_;  // hpZ: this rank's group of consecutive ranks
  std::unique_ptr<Comm> across_comm_, within_comm_;  // NOTE [hierarchical gather]
  MemoryLedger& ledger_;
  ParamSwapper* swapper_;
  int64_t world_size_ = 1;
  std::vector<Group> groups_;
  std::deque<size_t> unlaunched_;  // issued gathers not yet launched, in issue order
  std::vector<Event> trace_, current_;
  size_t cursor_ = 0;
  bool trusted_ = false;
  bool in_backward_ = false;
  std::function<void()> before_gather_;
  int64_t live_ = 0, peak_live_ = 0;
  CopyStream stream_;      // NOTE [stage-3 gather stream]
  WaitClock clock_;        // the compute stream's waits for gathers
  double read_wait_s_ = 0;  // the host's waits for shards from disk
  int64_t gathers_ = 0, prefetched_ = 0;
  // NOTE [ungathered use]: until the first micro-step has ended.
  std::unique_ptr<UngatheredUseCheck> use_check_;
  std::set<size_t> use_check_seen_;  // layers run while it watched
};

/// The coordinator and unit that handle `module`, if it is a stage-3 layer
/// of a live engine (NOTE [stage-3 layers]); a null coordinator otherwise.
struct LayerHandle {
  std::shared_ptr<Stage3Coordinator> coordinator;
  size_t unit = 0;
};
LayerHandle find_layer(const torch::nn::Module& module);

}  // namespace zero::partition
