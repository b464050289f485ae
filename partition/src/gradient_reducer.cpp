// NOTE [gradient path] in gradient_reducer.h.
#include "zero/partition/gradient_reducer.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "zero/core/error.h"
#include "zero/partition/quantized_reduce.h"
#include "zero/core/trace.h"

namespace zero::partition {
namespace {

// Stages 0-1: one flat gradient buffer, all-reduced at the boundary.
class AllReduceReducer final : public GradientReducer {
 public:
  AllReduceReducer(FlatParameters& params, Comm* comm, MemoryLedger& ledger, CopyStream& copies,
                   ReductionOptions options)
      : GradientReducer(params, comm, ledger, copies, options) {
    grads_ = LedgerAlloc::empty(ledger_, params_.padded_numel(), options_.accum_dtype, options_.device,
                                Tier::kDevice, Kind::kGradients, "flat gradient buffer");
    grads_.zero_();
    // A layout of one partition (stage 0) uses every group whole.
    owned_rank_ = params_.world_size() == 1 || comm_ == nullptr ? 0 : comm_->rank();
  }

  void begin_backward(bool boundary) override {
    reducing_ = boundary;
    std::fill(ready_.begin(), ready_.end(), 0);
    next_launch_ = 0;
  }

  void add(size_t index, const at::Tensor& grad) override {
    const auto& slot = params_.slots()[index];
    grads_.narrow(0, slot.offset, slot.numel).add_(grad.reshape({-1}));
    const auto& group = params_.groups()[slot.group];
    if (reducing_ && ++ready_[slot.group] == static_cast<int64_t>(group.slots.size()) && options_.overlap_comm)
      launch_ready();
  }

  void end_backward() override {
    if (reducing_) {
      const size_t n = params_.groups().size();
      for (; next_launch_ < n; ++next_launch_) launch(n - 1 - next_launch_);
    }
    wait_all();
    reducing_ = false;
  }

  void wait_all() override {
    for (auto& w : works_) {
      clock_.time([&] { w.work.wait(); }, "wait for a reduction");
      if (w.sent.defined()) w.range.copy_(w.sent);  // back from the communication dtype
    }
    works_.clear();
  }

  at::Tensor owned(size_t g) const override { return params_.chunk_of(grads_, g, owned_rank_); }
  bool owned_in_store() const override { return false; }

  void zero() override {
    wait_all();
    grads_.zero_();
  }

 private:
  void launch(size_t g) override {
    const trace::Span span("reduce", "reduce gradients", static_cast<int64_t>(g));
    if (!distributed()) {  // nothing to sum; the pre-scale still applies (the step divides it out)
      if (options_.pre_scale != 1.0) params_.group_of(grads_, g).mul_(options_.pre_scale);
      return;
    }
    Work w;
    w.range = params_.group_of(grads_, g);
    if (options_.comm_dtype) {
      w.sent = w.range.to(*options_.comm_dtype);
      if (options_.pre_scale != 1.0) w.sent.mul_(options_.pre_scale);
      w.work = comm_->all_reduce_sum(w.sent);
    } else {
      if (options_.pre_scale != 1.0) w.range.mul_(options_.pre_scale);
      w.work = comm_->all_reduce_sum(w.range);
    }
    works_.push_back(std::move(w));
  }

  struct Work {
    at::Tensor range;  // the group in the gradient buffer
    at::Tensor sent;   // its copy in the communication dtype (or undefined)
    CommWork work;
  };
  at::Tensor grads_;  // flat, accum dtype, laid out like the parameters
  int64_t owned_rank_ = 0;
  std::vector<Work> works_;
};

// Stages 2-3: a bucket per group, reduce-scattered every micro-step into the
// store's gradient partition.
class ReduceScatterReducer final : public GradientReducer {
 public:
  ReduceScatterReducer(FlatParameters& params, StateStore& store, Comm* comm, Comm* replicas, MemoryLedger& ledger,
                       CopyStream& copies, ReductionOptions options)
      : GradientReducer(params, comm, ledger, copies, options),
        store_(store),
        replicas_(replicas != nullptr && replicas->world_size() > 1 ? replicas : nullptr) {
    ZERO_CHECK(store_.has_grads(), "stages 2-3 need the store's gradient partition");
    staging_.resize(params_.groups().size());
    unsummed_.assign(params_.groups().size(), 0);
    if (options_.quantize_gradients && distributed())
      qgz_ = std::make_unique<QuantizedReduceScatter>(*comm_, options_.quant_block);
    ZERO_CHECK(qgz_ == nullptr || replicas_ == nullptr, "qgZ with MiCS replicas (the config refuses it)");
  }

  void begin_backward(bool boundary) override {
    reducing_ = true;
    boundary_ = boundary;
    std::fill(ready_.begin(), ready_.end(), 0);
    next_launch_ = 0;
  }

  void add(size_t index, const at::Tensor& grad) override {
    poll_host();
    const auto& slot = params_.slots()[index];
    const auto& group = params_.groups()[slot.group];
    at::Tensor& st = staging_[slot.group];
    if (!st.defined()) st = take_bucket(slot.group);
    st.narrow(0, slot.offset - group.begin, slot.numel).add_(grad.reshape({-1}));
    if (++ready_[slot.group] != static_cast<int64_t>(group.slots.size())) return;
    launch_ready();
    // Without overlap each complete bucket is reduced now, and waited for, as
    // DeepSpeed does: holding them all until the end of backward would keep a
    // whole-model gradient buffer.
    if (!options_.overlap_comm) finish(true);
  }

  void end_backward() override {
    const size_t n = params_.groups().size();
    for (; next_launch_ < n; ++next_launch_) launch(n - 1 - next_launch_);
    wait_all();
  }

  void wait_all() override {
    finish(true);
    settle_partition_sums(0);
    while (!to_host_.empty()) add_host();
  }

  // NOTE [MiCS]: a device partition accumulated in a window whose boundary
  // micro-step ran no backward is summed across the replicas now.
  void before_step() override {
    wait_all();
    if (replicas_ == nullptr) return;
    for (size_t g = 0; g < unsummed_.size(); ++g)
      if (unsummed_[g]) sum_partition(g);
    settle_partition_sums(0);
  }

  at::Tensor owned(size_t g) const override { return store_.grad(g); }
  bool owned_in_store() const override { return true; }

  void zero() override {
    wait_all();
    std::fill(unsummed_.begin(), unsummed_.end(), 0);
    store_.zero_grads();
    for (size_t g = 0; g < staging_.size(); ++g) release(g);
  }

 private:
  // Pinned buffers for reduced chunks on their way to the host, and so the
  // copies in flight (NOTE [offload transfers]).
  static constexpr size_t kHostBuffers = 2;
  struct Scatter;  // a bucket's reduction in flight (below)

  void launch(size_t g) override {
    const trace::Span span("reduce", "reduce gradients", static_cast<int64_t>(g));
    const auto& group = params_.groups()[g];
    at::Tensor& st = staging_[g];
    if (!st.defined()) st = take_bucket(g);  // no gradient of this group here; others may have
    if (!distributed() && replicas_ == nullptr) {
      if (options_.pre_scale != 1.0) st.mul_(options_.pre_scale);
      if (goes_to_host(g)) {  // the bucket is the owned chunk: to the host as it is
        to_host(g, st, /*recycle=*/st);
        st.reset();
      } else {
        store_.grad(g).add_(st);
        release(g);
      }
      return;
    }
    // qgZ sends int8 codes of the bucket as it is (NOTE [quantized gradients]).
    const at::ScalarType dtype = qgz_ != nullptr ? st.scalar_type() : options_.comm_dtype.value_or(options_.accum_dtype);
    at::Tensor send = dtype == st.scalar_type() ? st : st.to(dtype);
    if (options_.pre_scale != 1.0) send.mul_(options_.pre_scale);
    Scatter s{g, at::Tensor(), at::Tensor(), CommWork()};
    if (!distributed()) {  // NOTE [MiCS]: a partition of one rank; the bucket is its chunk
      s.whole = send;
      s.out = send;
    } else if (qgz_ != nullptr) {
      // NOTE [quantized gradients]: the first hop goes out now, the second
      // when the reduction is finished.
      s.out = chunks_.take(group.chunk_numel, dtype);
      s.payload_bytes = LedgerAlloc::reserve(ledger_, Tier::kDevice, Kind::kCommBuffers,
                                             qgz_->payload_bytes(send.numel()), "quantized gradient payloads (qgZ)");
      s.quantized = qgz_->start(send);
    } else if (options_.reduce_scatter && !comm_->reduce_scatter_copies_input()) {
      // The bucket is scratch: where a reduce-scatter would copy it whole
      // (Gloo), it is all-reduced in place (Comm::reduce_scatter_copies_input).
      s.out = chunks_.take(group.chunk_numel, dtype);
      s.work = comm_->reduce_scatter_sum(s.out, send);
    } else {  // reduce_scatter false: all-reduce the bucket, keep this rank's chunk
      s.whole = send.is_same(st) ? st : send;
      s.work = comm_->all_reduce_sum(s.whole);
      s.out = s.whole.narrow(0, comm_->rank() * group.chunk_numel, group.chunk_numel);
    }
    scatters_.push_back(std::move(s));
    // Bound the bucket memory: at most two buckets in flight (a reduction
    // past its first hop holds only its chunk, unless the chunk is part of
    // the bucket: an all-reduce in place), and two chunks in the second.
    auto buckets = [&] {
      return scatters_.size() + static_cast<size_t>(std::count_if(replicating_.begin(), replicating_.end(),
                                                                  [](const Scatter& r) { return r.whole.defined(); }));
    };
    while (buckets() > 2 || replicating_.size() > 2) finish(false);
  }

  // Takes the oldest reduction in flight one hop further (all: every one to
  // its end), in launch order: the first hop's wait, then, for a chunk bound
  // for the host under MiCS, the start of the replicas' sum (NOTE [MiCS]),
  // whose wait lands it.
  void finish(bool all) {
    while (!replicating_.empty() || !scatters_.empty()) {
      if (!replicating_.empty()) {
        Scatter& s = replicating_.front();
        clock_.time([&] { s.work.wait(); }, "wait for a reduction across the replicas");
        land(s);
        replicating_.pop_front();
      } else {
        Scatter& s = scatters_.front();
        if (s.quantized.chunk > 0) {
          clock_.time([&] { qgz_->finish(s.quantized, s.out); }, "wait for a reduction");
          s.payload_bytes = LedgerReservation();
        } else {
          clock_.time([&] { s.work.wait(); }, "wait for a reduction");
        }
        if (replicas_ != nullptr && goes_to_host(s.group)) {
          s.work = replicas_->all_reduce_sum(s.out);
          if (!s.whole.defined()) release(s.group);  // the chunk is its own: the bucket is free
          replicating_.push_back(std::move(s));
        } else {
          land(s);
        }
        scatters_.pop_front();
      }
      if (!all) break;
    }
  }

  // A reduced chunk, summed over every rank that reduces it: into the
  // device's partition (at the boundary under MiCS, the partition then
  // summed across the replicas), or on its way to the host's.
  void land(Scatter& s) {
    if (!goes_to_host(s.group)) {
      store_.grad(s.group).add_(s.out);
      if (replicas_ != nullptr) {
        if (boundary_) sum_partition(s.group);
        else unsummed_[s.group] = 1;
      }
      release(s.group);
      if (!s.whole.defined()) chunks_.give(s.out);
    } else if (s.whole.defined() && s.whole.is_same(staging_[s.group])) {
      // All-reduced in place: the bucket is what goes to the host.
      to_host(s.group, s.out, /*recycle=*/staging_[s.group]);
      staging_[s.group].reset();
    } else {
      // The reduced chunk goes to the host: back to its pool once copied.
      to_host(s.group, s.out, /*recycle=*/s.whole.defined() ? at::Tensor() : s.out, /*chunk=*/!s.whole.defined());
      release(s.group);
    }
  }

  // NOTE [MiCS]: group g's partition on the device, accumulated over the
  // window's micro-steps, all-reduced across the replicas in place (in the
  // communication dtype, through a copy, when one is set).
  void sum_partition(size_t g) {
    unsummed_[g] = 0;
    PartitionSum p;
    p.range = store_.grad(g);
    if (options_.comm_dtype && *options_.comm_dtype != p.range.scalar_type()) {
      p.sent = LedgerAlloc::empty(ledger_, p.range.numel(), *options_.comm_dtype, p.range.device(), Tier::kDevice,
                                  Kind::kCommBuffers, "MiCS replica sum of a gradient partition");
      p.sent.copy_(p.range);
      p.work = replicas_->all_reduce_sum(p.sent);
    } else {
      p.work = replicas_->all_reduce_sum(p.range);
    }
    partition_sums_.push_back(std::move(p));
    // The copies in the communication dtype: two at a time, as buckets.
    if (options_.comm_dtype) settle_partition_sums(2);
  }

  // Waits for the oldest replica sums of partitions until at most `keep` are in flight.
  void settle_partition_sums(size_t keep) {
    while (partition_sums_.size() > keep) {
      PartitionSum& p = partition_sums_.front();
      clock_.time([&] { p.work.wait(); }, "wait for a reduction across the replicas");
      if (p.sent.defined()) p.range.copy_(p.sent);  // back from the communication dtype
      partition_sums_.pop_front();
    }
  }

  // Whether group g's reduced chunk goes to the host: offloaded, and its
  // gradient partition there (NOTE [partial offload]: a device group's stays
  // on the device; NOTE [device gradients]: every group's may).
  bool goes_to_host(size_t g) const { return options_.to_host && store_.grad_on_host(g); }

  // NOTE [offload transfers]: the reduced chunk of group g goes to pinned
  // buffers on the copy stream, in pieces of at most host_staging_numel
  // elements (the buffers hold a piece, not a whole chunk: with DeepSpeed's
  // default buckets a chunk is a rank's whole partition); the host adds each
  // into the host's partition later (add_host). `recycle` (if defined): the
  // bucket `reduced` lives in, reused once the copy of its last piece has
  // ended (the copies run in stream order).
  void to_host(size_t g, const at::Tensor& reduced, at::Tensor recycle, bool chunk = false) {
    const int64_t piece = std::max<int64_t>(1, options_.host_staging_numel);
    if (!ring_.defined()) {
      int64_t largest = 0;
      for (const auto& grp : params_.groups()) largest = std::max(largest, grp.chunk_numel);
      ring_ = HostRing(ledger_, options_.pin_memory, kHostBuffers, std::min(largest, piece), reduced.scalar_type(),
                       "gradient staging for the host");
    }
    const int64_t n = reduced.numel();
    for (int64_t offset = 0; offset < n; offset += piece) {
      const int64_t len = std::min(piece, n - offset);
      // As many copies pending as buffers: the oldest is added in, freeing its buffer.
      while (to_host_.size() >= kHostBuffers) add_host();
      at::Tensor host = ring_.next(len, copy_wait_s_);
      StreamEvent done = copies_.copy(host, reduced.narrow(0, offset, len));
      ring_.used_by(done);
      to_host_.push_back({g, offset, host, done, offset + len >= n ? std::move(recycle) : at::Tensor(), chunk});
    }
    poll_host();
  }

  // Pieces whose copies have ended are added in now, without waiting: a
  // group's host gradient is then complete as soon as its copies are (NOTE
  // [speculative step] steps it from there), not when its buffer is needed.
  void poll_host() {
    while (!to_host_.empty() && to_host_.front().done.query()) add_host();
  }

  void add_host() {
    HostGrad h = std::move(to_host_.front());
    to_host_.pop_front();
    const auto t0 = std::chrono::steady_clock::now();
    h.done.synchronize();
    copy_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    store_.grad(h.group).narrow(0, h.offset, h.host.numel()).add_(h.host);
    if (h.recycle.defined()) (h.chunk ? chunks_ : buckets_).give(h.recycle);
    if (on_host_final_ && h.offset + h.host.numel() == params_.groups()[h.group].chunk_numel) on_host_final_(h.group);
  }

  // A bucket, zeroed (NOTE [buffer pools]).
  at::Tensor take_bucket(size_t g) { return buckets_.take(params_.groups()[g].padded_numel, options_.accum_dtype).zero_(); }

  void release(size_t g) {
    at::Tensor& st = staging_[g];
    if (st.defined()) buckets_.give(st);
    st.reset();
  }

  // NOTE [buffer pools]
  // Buckets and reduced chunks come from pools that keep every buffer they
  // made for the next micro-step (contiguous_gradients, as DeepSpeed keeps
  // its buffers), so the memory they hold is set by how many this process's
  // bookkeeping had in use at once, a count fixed by the layout and the
  // bucket bounds, never by when a collective library lets go of a tensor:
  // a freed bucket that c10d's Gloo worker still referenced a moment longer
  // stayed allocated while the next one was made, and the comm_buffers peak
  // of an unchanged run grew 9% on a loaded machine (zero memcheck). A
  // buffer goes back to its pool once its collective has been waited for,
  // so reusing it is safe whoever else still holds a reference.
  // contiguous_gradients false gives buffers back to the allocator instead.
  class Pool {
   public:
    Pool(ReduceScatterReducer& r, const char* what) : r_(r), what_(what) {}
    /// A buffer of at least `numel` elements (its first `numel`).
    at::Tensor take(int64_t numel, at::ScalarType dtype) {
      for (auto& e : all_) {
        if (e.free && e.whole.numel() >= numel && e.whole.scalar_type() == dtype) {
          e.free = false;
          return e.whole.narrow(0, 0, numel);
        }
      }
      all_.push_back({LedgerAlloc::empty(r_.ledger_, numel, dtype, r_.options_.device, Tier::kDevice,
                                         Kind::kCommBuffers, what_),
                      false});
      return all_.back().whole;
    }
    /// `t` (from take()) is free for the next take(); without
    /// contiguous_gradients its memory goes back to the allocator.
    void give(const at::Tensor& t) {
      for (size_t i = 0; i < all_.size(); ++i) {
        if (!all_[i].whole.storage().is_alias_of(t.storage())) continue;
        if (r_.options_.reuse_buckets) all_[i].free = true;
        else all_.erase(all_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }

   private:
    struct Entry {
      at::Tensor whole;
      bool free;
    };
    ReduceScatterReducer& r_;
    const char* what_;
    std::vector<Entry> all_;
  };


  struct Scatter {
    size_t group;
    at::Tensor out;    // this rank's reduced chunk
    at::Tensor whole;  // reduce_scatter false: the all-reduced bucket
    CommWork work;
    QuantizedReduceScatter::Pending quantized = {};  // qgZ: between its hops
    LedgerReservation payload_bytes = {};
  };
  struct HostGrad {
    size_t group;
    int64_t offset;  // of the piece in the group's partition
    at::Tensor host;
    StreamEvent done;
    at::Tensor recycle;
    bool chunk = false;  // `recycle` is a reduced chunk (else a bucket)
  };
  struct PartitionSum {
    at::Tensor range;  // a group's gradient partition
    at::Tensor sent;   // its copy in the communication dtype (or undefined)
    CommWork work;
  };
  StateStore& store_;
  Comm* replicas_;               // NOTE [MiCS] (null without replicas)
  bool boundary_ = false;        // this micro-step ends the accumulation window
  std::deque<Scatter> replicating_;  // chunks for the host, being summed across the replicas
  std::deque<PartitionSum> partition_sums_;  // the boundary's, in flight
  std::vector<char> unsummed_;  // per group: a device partition accumulated since the replicas' last sum
  std::vector<at::Tensor> staging_;  // per group, while in use
  Pool buckets_{*this, "stage-2 gradient bucket"};
  Pool chunks_{*this, "stage-2 reduced chunk"};
  std::deque<Scatter> scatters_;     // collectives in flight
  std::unique_ptr<QuantizedReduceScatter> qgz_;  // zero_quantized_gradients
  HostRing ring_;
  std::deque<HostGrad> to_host_;
};

}  // namespace

GradientReducer::GradientReducer(FlatParameters& params, Comm* comm, MemoryLedger& ledger, CopyStream& copies,
                                 ReductionOptions options)
    : params_(params),
      comm_(comm),
      ledger_(ledger),
      copies_(copies),
      options_(options),
      ready_(params.groups().size(), 0),
      clock_(options.device) {
  if (options_.comm_dtype && *options_.comm_dtype == options_.accum_dtype) options_.comm_dtype.reset();
}

std::unique_ptr<GradientReducer> GradientReducer::create(int stage, FlatParameters& params, StateStore& store,
                                                         Comm* comm, MemoryLedger& ledger, CopyStream& copies,
                                                         ReductionOptions options, Comm* replicas) {
  if (stage >= 2) return std::make_unique<ReduceScatterReducer>(params, store, comm, replicas, ledger, copies, options);
  ZERO_CHECK(replicas == nullptr, "MiCS replicas at stages 2-3 (NOTE [MiCS])");
  return std::make_unique<AllReduceReducer>(params, comm, ledger, copies, options);
}

// Groups start in descending order (backward produces the last layers'
// gradients first), and never out of that order, so all ranks match.
void GradientReducer::launch_ready() {
  const size_t n = params_.groups().size();
  while (next_launch_ < n) {
    const size_t g = n - 1 - next_launch_;
    if (ready_[g] != static_cast<int64_t>(params_.groups()[g].slots.size())) break;
    launch(g);
    ++next_launch_;
  }
}

}  // namespace zero::partition
