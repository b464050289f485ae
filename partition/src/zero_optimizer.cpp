#include "zero/core/ledger_alloc.h"
#include "zero/partition/zero_optimizer.h"

#include <chrono>
#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::partition {
namespace {

// Pinned staging buffers for reduced gradient chunks on their way to the
// host, and so the copies in flight (NOTE [offload transfers]).
constexpr size_t kHostGradBuffers = 2;

class GradReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(ZeroOptimizer* owner, size_t index) : owner_(owner), index_(index) {}
  void operator()(const torch::autograd::Variable& param) override {
    auto& grad = const_cast<torch::autograd::Variable&>(param).mutable_grad();
    if (!grad.defined()) return;
    owner_->on_grad_ready(index_, grad);
    grad.reset();  // the flat buffers hold it now
  }

 private:
  ZeroOptimizer* owner_;
  size_t index_;
};

at::ScalarType dtype_from_name(const std::string& name) {
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

}  // namespace

at::ScalarType compute_dtype(const config::Config& c) {
  if (c.fp16.enabled) return at::kHalf;
  if (c.bf16.enabled) return at::kBFloat16;
  return at::kFloat;
}

at::ScalarType grad_accum_dtype(const config::Config& c) {
  if (c.grad_accum_dtype) return dtype_from_name(*c.grad_accum_dtype);
  return c.fp16.enabled ? at::kHalf : at::kFloat;
}

namespace {

// A buffer of the owned partition: on the device, or with optimizer offload in
// host memory, pinned when asked and within the ledger's pinned limit.
at::Tensor state_buffer(MemoryLedger& ledger, const ZeroOptimizerOptions& o, int64_t numel,
                        at::ScalarType dtype, Kind kind, const std::string& what) {
  if (!o.offload_optimizer) return LedgerAlloc::empty(ledger, numel, dtype, o.device, Tier::kDevice, kind, what);
  return LedgerAlloc::host_empty(ledger, numel, dtype, o.pin_memory, kind, what);
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                             std::unique_ptr<optim::FlatOptimizer> optimizer,
                             ZeroOptimizerOptions options, MemoryLedger& ledger, Comm* comm)
    : options_(options),
      optimizer_(std::move(optimizer)),
      comm_(comm),
      ledger_(ledger),
      copies_(options.device, options.copy_mode),
      comm_clock_(options.device),
      gather_clock_(options.device) {
  ZERO_CHECK(optimizer_ != nullptr, "an optimizer is required");
  ZERO_CHECK(options_.stage >= 0 && options_.stage <= 2, "stage 0, 1 or 2 (stage 3 takes a Stage3Layout)");
  if (comm_ != nullptr) {
    world_size_ = comm_->world_size();
    rank_ = comm_->rank();
  }
  // Stage 0 replicates everything: its layout has one partition.
  const int64_t layout_ws = options_.stage == 0 ? 1 : world_size_;
  flat_ = std::make_unique<FlatParameters>(named_params, options_.compute_dtype, options_.device,
                                           layout_ws, options_.bucket_numel, ledger);
  if (options_.nvme) options_.offload_optimizer = true;
  ZERO_CHECK(!options_.offload_optimizer || options_.stage >= 1, "optimizer offload needs stage 1 or more");
  init_states();
}

ZeroOptimizer::ZeroOptimizer(Stage3Layout layout, std::unique_ptr<optim::FlatOptimizer> optimizer,
                             ZeroOptimizerOptions options, MemoryLedger& ledger, Comm* comm)
    : options_(options),
      optimizer_(std::move(optimizer)),
      comm_(comm),
      ledger_(ledger),
      copies_(options.device, options.copy_mode),
      comm_clock_(options.device),
      gather_clock_(options.device) {
  ZERO_CHECK(optimizer_ != nullptr, "an optimizer is required");
  ZERO_CHECK(options_.stage == 3, "a Stage3Layout is for stage 3");
  if (comm_ != nullptr) {
    world_size_ = comm_->world_size();
    rank_ = comm_->rank();
  }
  if (options_.nvme) options_.offload_optimizer = true;
  if (layout.nvme_param) layout.offload_param = params_on_disk_ = true;
  const Tier tier = !layout.offload_param ? Tier::kDevice : layout.pin_param ? Tier::kPinnedHost : Tier::kHost;
  try {
    flat_ = std::make_unique<FlatParameters>(layout.groups, options_.compute_dtype, options_.device, world_size_,
                                             rank_, tier, ledger);
  } catch (const OutOfMemoryError& e) {
    if (tier != Tier::kPinnedHost) throw;
    log::warning_once("offload.pinned", std::string(e.what()) +
                                            "; using pageable host memory for the parameter partition (slower copies)");
    flat_ = std::make_unique<FlatParameters>(layout.groups, options_.compute_dtype, options_.device, world_size_,
                                             rank_, Tier::kHost, ledger);
  }
  // The swapper first: shards zero::Init wrote to disk are only there, and
  // the master copies the shards (through shard()); the others leave host
  // memory after that, so they are not read back.
  if (layout.nvme_param) param_swapper_ = std::make_unique<ParamSwapper>(*flat_, *layout.nvme_param, ledger);
  init_states();
  if (param_swapper_) {
    param_swapper_->swap_out();
    param_swapper_->clear_timings();
  }
  layout.options.shards_offloaded = layout.offload_param;
  layout.options.copy_mode = options_.copy_mode;
  stage3_ = Stage3Coordinator::create(*flat_, std::move(layout.units), layout.options, options_.device, comm_, ledger,
                                      param_swapper_.get());
  if (param_swapper_) param_swapper_->finish_a_gather = [this] { return stage3_->finish_a_gather(); };
}

void ZeroOptimizer::init_states() {
  auto& ledger = ledger_;
  {  // The step's pieces: sub_group_size elements at most, never across two groups.
    const int64_t size = std::max<int64_t>(1, options_.sub_group_size);
    for (size_t g = 0; g < flat_->groups().size(); ++g) {
      const int64_t n = flat_->groups()[g].chunk_numel;
      for (int64_t start = 0; start < n; start += size) sub_groups_.push_back({g, start, std::min(size, n - start)});
    }
  }

  const auto dev = options_.device;
  const int64_t layout_ws = options_.stage == 0 ? 1 : world_size_;
  if (options_.stage >= 2) {
    // Offloaded, the partition accumulates in fp32 on the host, as DeepSpeed's.
    owned_grads_ = state_buffer(ledger, options_, flat_->owned_numel(),
                                options_.offload_optimizer ? at::kFloat : options_.grad_accum_dtype,
                                Kind::kGradients, "owned gradient partition");
    owned_grads_.zero_();
  } else {
    grads_ = LedgerAlloc::empty(ledger, flat_->padded_numel(), options_.grad_accum_dtype, dev, Tier::kDevice,
                          Kind::kGradients, "flat gradient buffer");
    grads_.zero_();
  }
  if (flat_->stage3()) {
    // The partition is the fp32 master itself when it is fp32 on the device.
    master_is_param_ = options_.compute_dtype == at::kFloat && !options_.offload_optimizer && !params_on_disk_ &&
                       flat_->part(0).device() == options_.device;
  } else {
    master_is_param_ = options_.compute_dtype == at::kFloat && layout_ws == 1 && !options_.offload_optimizer;
  }
  if (options_.nvme) {
    init_swapped_states();
  } else if (master_is_param_) {
    if (!flat_->stage3()) master_ = flat_->flat();  // stage 3: the shards themselves (master_chunk)
  } else {
    master_ = state_buffer(ledger, options_, flat_->owned_numel(), at::kFloat, Kind::kOptimizerStates,
                           "fp32 master parameters");
    if (flat_->stage3()) {
      for (size_t g = 0; g < flat_->groups().size(); ++g) {
        flat_->owned_chunk_of(master_, g).copy_(shard(g));
        shard_done(g);
      }
    } else {
      const int64_t layout_rank = layout_ws == 1 ? 0 : rank_;
      for (size_t g = 0; g < flat_->groups().size(); ++g)
        flat_->owned_chunk_of(master_, g).copy_(flat_->chunk_of(flat_->flat(), g, layout_rank));
    }
  }
  for (int i = 0; i < optimizer_->num_states() && !options_.nvme; ++i) {
    auto s = state_buffer(ledger, options_, flat_->owned_numel(), at::kFloat, Kind::kOptimizerStates,
                          "optimizer state " + optimizer_->state_names()[i]);
    s.zero_();
    states_.push_back(std::move(s));
  }
  const size_t n_groups = flat_->groups().size();
  ready_.assign(n_groups, 0);
  staging_.resize(n_groups);
  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(slots[i].param,
                                                   std::make_unique<GradReadyHook>(this, i));
  }
}

// The master starts as this rank's chunk of the parameters and the states as
// zeros, written to the swap files one sub-group at a time.
void ZeroOptimizer::init_swapped_states() {
  std::vector<int64_t> numels;
  for (const auto& g : flat_->groups()) numels.push_back(g.chunk_numel);
  const int64_t size = std::max<int64_t>(1, options_.sub_group_size);
  std::vector<std::string> names{"fp32_master"};
  for (const auto& n : optimizer_->state_names()) names.push_back(n);
  swapper_ = std::make_unique<StateSwapper>(sub_groups_of(numels, size), names, *options_.nvme, ledger_);
  const int64_t layout_rank = options_.stage == 0 || world_size_ == 1 ? 0 : rank_;
  swapper_->pass(/*read=*/false, /*write=*/true, [&](size_t k, const std::vector<at::Tensor>& t) {
    const auto [g, start, len] = sub_groups_[k];
    const at::Tensor chunk = flat_->stage3() ? shard(g) : flat_->chunk_of(flat_->flat(), g, layout_rank);
    t[0].copy_(chunk.narrow(0, start, t[0].numel()));
    for (size_t i = 1; i < t.size(); ++i) t[i].zero_();
    if (flat_->stage3() && (k + 1 == sub_groups_.size() || sub_groups_[k + 1].group != g)) shard_done(g);
  });
  swapper_->clear_timings();
}

ZeroOptimizer::~ZeroOptimizer() {
  for (const auto& slot : flat_->slots())
    torch::autograd::impl::set_post_acc_grad_hooks(slot.param, nullptr);
}

void ZeroOptimizer::begin_backward(bool boundary) {
  in_backward_ = true;
  if (boundary && swapper_) swapper_->prefetch();  // the step's first states arrive behind backward
  reducing_ = options_.stage >= 2 || boundary;
  std::fill(ready_.begin(), ready_.end(), 0);
  next_launch_ = 0;
}

void ZeroOptimizer::on_grad_ready(size_t index, const at::Tensor& grad) {
  if (!in_backward_) outside_backward_ = true;
  const auto& slot = flat_->slots()[index];
  const auto& group = flat_->groups()[slot.group];
  if (options_.stage >= 2) {
    at::Tensor& st = staging_[slot.group];
    if (!st.defined()) st = take_staging(slot.group);
    st.narrow(0, slot.offset - group.begin, slot.numel).add_(grad.reshape({-1}));
  } else {
    grads_.narrow(0, slot.offset, slot.numel).add_(grad.reshape({-1}));
  }
  if (reducing_ && ++ready_[slot.group] == static_cast<int64_t>(group.slots.size())) {
    if (options_.overlap_comm) {
      launch_ready_groups();
    } else if (options_.stage >= 2) {
      // Without overlap, stages 2 and 3 still reduce each complete bucket now
      // (and wait for it), as DeepSpeed does: holding them all until the end of
      // backward would keep a whole-model gradient buffer.
      launch_ready_groups();
      finish_reduce_scatter(true);
    }
  }
}

// Groups start in descending order (backward produces the last layers'
// gradients first), and never out of that order, so all ranks match.
void ZeroOptimizer::launch_ready_groups() {
  const size_t n = flat_->groups().size();
  while (next_launch_ < n) {
    const size_t g = n - 1 - next_launch_;
    if (ready_[g] != static_cast<int64_t>(flat_->groups()[g].slots.size())) break;
    launch_group(g);
    ++next_launch_;
  }
}

void ZeroOptimizer::launch_group(size_t g) {
  const auto& group = flat_->groups()[g];
  const bool distributed = comm_ != nullptr && world_size_ > 1;
  if (options_.stage >= 2) {
    at::Tensor& st = staging_[g];
    if (!st.defined()) st = take_staging(g);  // no gradient of this group here; others may have
    if (!distributed) {
      if (options_.offload_optimizer) {  // the bucket is the owned chunk: to the host as it is
        grad_to_host(g, st, /*recycle=*/true);
        st.reset();
      } else {
        flat_->owned_chunk_of(owned_grads_, g).add_(st);
        release_staging(g);
      }
      return;
    }
    at::Tensor out = LedgerAlloc::empty(ledger_, group.chunk_numel, options_.grad_accum_dtype, options_.device,
                                   Tier::kDevice, Kind::kCommBuffers, "stage-2 reduced chunk");
    CommWork work = comm_->reduce_scatter_sum(out, st);
    scatters_.push_back({g, out, std::move(work)});
    // Bound the staging memory: at most two buckets in flight.
    while (scatters_.size() > 2) finish_reduce_scatter(false);
  } else if (distributed) {
    at::Tensor range = flat_->group_of(grads_, g);
    works_.push_back(comm_->all_reduce_sum(range));
  }
}

void ZeroOptimizer::finish_reduce_scatter(bool all) {
  while (!scatters_.empty()) {
    auto& s = scatters_.front();
    comm_clock_.time([&] { s.work.wait(); });
    if (options_.offload_optimizer) grad_to_host(s.group, s.out, /*recycle=*/false);
    else flat_->owned_chunk_of(owned_grads_, s.group).add_(s.out);
    release_staging(s.group);
    scatters_.pop_front();
    if (!all) break;
  }
}

// NOTE [offload transfers]: the reduced chunk of group g goes to a pinned
// staging buffer on the copy stream; the host adds it into the fp32
// partition later (add_host_grad). `recycle`: `reduced` is a staging bucket,
// reused once the copy out of it has ended.
void ZeroOptimizer::grad_to_host(size_t g, const at::Tensor& reduced, bool recycle) {
  if (!grad_ring_.defined()) {
    int64_t largest = 0;
    for (const auto& grp : flat_->groups()) largest = std::max(largest, grp.chunk_numel);
    grad_ring_ = HostRing(ledger_, options_.pin_memory, kHostGradBuffers, largest, options_.grad_accum_dtype,
                          "gradient staging for the host");
  }
  // As many copies pending as buffers: the oldest is added in, freeing its buffer.
  while (host_grads_.size() >= kHostGradBuffers) add_host_grad();
  at::Tensor host = grad_ring_.next(reduced.numel(), copy_wait_s_);
  StreamEvent done = copies_.copy(host, reduced);
  grad_ring_.used_by(done);
  host_grads_.push_back({g, host, done, recycle ? reduced : at::Tensor()});
}

void ZeroOptimizer::add_host_grad() {
  HostGrad h = std::move(host_grads_.front());
  host_grads_.pop_front();
  const auto t0 = std::chrono::steady_clock::now();
  h.done.synchronize();
  copy_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  flat_->owned_chunk_of(owned_grads_, h.group).add_(h.host);
  if (h.recycle.defined() && spare_staging_.size() < 2) spare_staging_.push_back(h.recycle);
}

// Stage 2's bucket buffers: reused rather than allocated every micro-step. At
// most two spares are kept, the same bound as the buckets in flight.
at::Tensor ZeroOptimizer::take_staging(size_t g) {
  const int64_t numel = flat_->groups()[g].padded_numel;
  for (size_t i = 0; i < spare_staging_.size(); ++i) {
    if (spare_staging_[i].numel() >= numel) {
      at::Tensor t = spare_staging_[i].narrow(0, 0, numel);
      spare_staging_.erase(spare_staging_.begin() + static_cast<std::ptrdiff_t>(i));
      return t.zero_();
    }
  }
  return LedgerAlloc::empty(ledger_, numel, options_.grad_accum_dtype, options_.device, Tier::kDevice, Kind::kCommBuffers,
                       "stage-2 gradient bucket")
      .zero_();
}

void ZeroOptimizer::release_staging(size_t g) {
  at::Tensor& st = staging_[g];
  if (st.defined() && spare_staging_.size() < 2) spare_staging_.push_back(st);
  st.reset();
}

void ZeroOptimizer::wait_all() {
  for (auto& w : works_) comm_clock_.time([&] { w.wait(); });
  works_.clear();
  finish_reduce_scatter(true);
  while (!host_grads_.empty()) add_host_grad();
}

void ZeroOptimizer::end_backward() {
  if (reducing_) {
    const size_t n = flat_->groups().size();
    for (; next_launch_ < n; ++next_launch_) launch_group(n - 1 - next_launch_);
  }
  wait_all();
  reducing_ = false;
  in_backward_ = false;
  if (stage3_) stage3_->end_backward();
}

at::Tensor ZeroOptimizer::master_chunk(size_t g) const {
  if (master_is_param_ && flat_->stage3()) return flat_->part(g);
  return flat_->owned_chunk_of(master_, g);
}

at::Tensor ZeroOptimizer::owned_grad_chunk(size_t g) const {
  if (options_.stage >= 2) return flat_->owned_chunk_of(owned_grads_, g);
  return flat_->chunk_of(grads_, g, options_.stage == 0 ? 0 : rank_);
}

void ZeroOptimizer::zero_grad() {
  wait_all();
  if (grads_.defined()) grads_.zero_();
  if (owned_grads_.defined()) owned_grads_.zero_();
  for (size_t g = 0; g < staging_.size(); ++g) release_staging(g);
  for (const auto& slot : flat_->slots()) slot.param.mutable_grad().reset();
}

StepOutcome ZeroOptimizer::step(const optim::StepParams& params, double loss_scale, double clip) {
  at::NoGradGuard no_grad;
  wait_all();
  if (outside_backward_) {
    outside_backward_ = false;
    zero_grad();
    throw UsageError(
                "gradients of the engine's parameters were produced by a plain loss.backward(); call "
                "engine.backward(loss) instead, which applies the loss scale and 1/gradient_accumulation_steps "
                "and reduces gradients across ranks (those gradients were discarded)");
  }
  StepOutcome out;
  const size_t n_groups = flat_->groups().size();
  // Sum of squares of the owned gradients, over all ranks when partitioned.
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(options_.device));
  for (size_t g = 0; g < n_groups; ++g) {
    at::Tensor n = at::linalg_vector_norm(owned_grad_chunk(g), 2, c10::nullopt, false, at::kFloat);
    sumsq.add_(n.to(options_.device, at::kDouble).pow(2));
  }
  if (partitioned()) comm_->all_reduce_sum(sumsq).wait();
  const double total_sumsq = sumsq.item<double>();
  // Reductions summed over ranks: the average's 1/world_size joins the unscale.
  const double scale_total = loss_scale * static_cast<double>(world_size_);
  out.grad_norm = std::sqrt(total_sumsq) / scale_total;
  if (!std::isfinite(total_sumsq) && options_.check_overflow) {
    zero_grad();
    return out;
  }
  double combined = scale_total;  // DeepSpeed's unscale_and_clip_grads: one factor
  if (clip > 0) {
    const double ratio = (out.grad_norm + 1e-6) / clip;
    if (ratio > 1) combined *= ratio;
  }
  // Where the updated values go in the compute dtype: the model's own chunk
  // (one partition), or the buffer this rank's chunk is all-gathered from.
  // The optimizer writes it in the same pass as the update.
  std::vector<at::Tensor> outs(n_groups);
  // A shard on disk gets its buffer when its first values are ready.
  auto on_disk = [&](size_t g) { return param_swapper_ != nullptr && param_swapper_->on_disk(g); };
  if (stage3_) {
    // Shards in host memory are written below: the copies out of them end first.
    for (size_t g = 0; g < n_groups; ++g)
      if (!on_disk(g)) stage3_->wait_shard_copies(g);
  }
  for (size_t g = 0; g < n_groups && !master_is_param_; ++g) {
    if (flat_->stage3()) {
      if (!on_disk(g)) outs[g] = flat_->part(g);
    } else {
      outs[g] = partitioned() ? at::empty({flat_->groups()[g].chunk_numel},
                                          at::TensorOptions().dtype(options_.compute_dtype).device(options_.device))
                              : flat_->chunk_of(flat_->flat(), g, 0);
    }
  }
  // NOTE [offload transfers]. The new values of a device-side destination
  // pass through pinned buffers (not when stage 3 keeps its shards in host
  // memory: they are written in place). Stage 1's gradients come the other
  // way, a sub-group ahead.
  const bool values_to_device =
      options_.offload_optimizer && !master_is_param_ && !(stage3_ && stage3_->shards_offloaded());
  const bool grads_from_device = options_.offload_optimizer && options_.stage < 2;
  int64_t piece = 0;
  for (const auto& sg : sub_groups_) piece = std::max(piece, sg.numel);
  if (values_to_device && !param_ring_.defined())
    param_ring_ = HostRing(ledger_, options_.pin_memory, 2, piece, options_.compute_dtype, "parameters for the device");
  if (grads_from_device && !grad_ring_.defined())
    grad_ring_ = HostRing(ledger_, options_.pin_memory, 2, piece, options_.grad_accum_dtype, "gradients for the host");
  std::vector<StreamEvent> to_device(n_groups);  // per group: its last copy of new values
  StreamEvent last_to_device;                     // of all groups (one stream: the others end before it)
  std::deque<std::pair<at::Tensor, StreamEvent>> grads_ahead;  // stage 1: sub-groups k, k+1 on their way
  size_t next_grad = 0;
  auto fetch_grad = [&]() {
    const auto& sg = sub_groups_[next_grad++];
    at::Tensor host = grad_ring_.next(sg.numel, copy_wait_s_);
    StreamEvent done = copies_.copy(host, owned_grad_chunk(sg.group).narrow(0, sg.start, sg.numel));
    grad_ring_.used_by(done);
    grads_ahead.emplace_back(host, done);
  };
  // Sub-group k: m, s its master and states.
  auto update = [&](size_t k, at::Tensor m, std::vector<at::Tensor> s) {
    const auto [g, start, len] = sub_groups_[k];
    if (on_disk(g) && !outs[g].defined()) outs[g] = param_swapper_->begin_update(g);
    at::Tensor g32;
    if (grads_from_device) {
      while (next_grad < sub_groups_.size() && next_grad <= k + 1) fetch_grad();
      auto [host, done] = std::move(grads_ahead.front());
      grads_ahead.pop_front();
      const auto t0 = std::chrono::steady_clock::now();
      done.synchronize();
      copy_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      g32 = host.to(at::kFloat);
    } else {
      g32 = owned_grad_chunk(g).narrow(0, start, len).to(m.device(), at::kFloat);
    }
    if (combined != 1.0) g32.mul_(1.0 / combined);
    if (!outs[g].defined()) {
      optimizer_->update(params, m, g32, s, nullptr);
    } else if (values_to_device) {
      at::Tensor low = param_ring_.next(len, copy_wait_s_);
      optimizer_->update(params, m, g32, s, &low);
      to_device[g] = last_to_device = copies_.copy(outs[g].narrow(0, start, len), low, /*host_source=*/true);
      param_ring_.used_by(to_device[g]);
    } else {
      at::Tensor low = outs[g].narrow(0, start, len);
      optimizer_->update(params, m, g32, s, &low);
    }
  };
  std::vector<CommWork> gathers;
  auto group_done = [&](size_t g) {
    if (on_disk(g) && outs[g].defined()) {  // the new shard goes back to disk
      param_swapper_->end_update(g);
      outs[g] = at::Tensor();
    }
    if (!partitioned() || flat_->stage3()) return;
    to_device[g].block_current();  // the all-gather sends what the copies brought
    at::Tensor range = flat_->group_of(flat_->flat(), g);
    gathers.push_back(comm_->all_gather(range, outs[g]));
  };
  auto visit = [&](size_t k, at::Tensor m, std::vector<at::Tensor> s) {
    update(k, std::move(m), std::move(s));
    const size_t g = sub_groups_[k].group;
    if (k + 1 == sub_groups_.size() || sub_groups_[k + 1].group != g) group_done(g);
  };
  if (swapper_) {
    swapper_->pass(/*read=*/true, /*write=*/true, [&](size_t k, const std::vector<at::Tensor>& t) {
      visit(k, t[0], std::vector<at::Tensor>(t.begin() + 1, t.end()));
    });
  } else {
    for (size_t k = 0; k < sub_groups_.size(); ++k) {
      const auto [g, start, len] = sub_groups_[k];
      std::vector<at::Tensor> s;
      for (auto& st : states_) s.push_back(flat_->owned_chunk_of(st, g).narrow(0, start, len));
      visit(k, master_chunk(g).narrow(0, start, len), std::move(s));
    }
  }
  for (auto& w : gathers) gather_clock_.time([&] { w.wait(); });
  // What the next forward (and stage 3's regathering) reads must have arrived:
  // the compute stream waits for the copies, in stream order the last of them.
  last_to_device.block_current();
  if (stage3_) stage3_->after_step();
  zero_grad();
  out.applied = true;
  return out;
}

// In double, group by group (a group at a time bounds the temporary), so two
// layouts of the same values give the same norm to about 1e-15.
double ZeroOptimizer::parameter_l2() const {
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(options_.device));
  for (size_t g = 0; g < flat_->groups().size(); ++g) {
    const at::Tensor values = flat_->stage3() ? shard(g) : flat_->group_of(flat_->flat(), g);
    sumsq.add_(at::linalg_vector_norm(values, 2, c10::nullopt, false, at::kDouble).to(options_.device).pow(2));
    if (flat_->stage3()) shard_done(g);
  }
  // Stage 3: each rank has its shards; padding is zero.
  if (flat_->stage3() && comm_ != nullptr && world_size_ > 1) comm_->all_reduce_sum(sumsq).wait();
  return std::sqrt(sumsq.item<double>());
}

const at::Tensor& ZeroOptimizer::shard(size_t g) const {
  if (param_swapper_ != nullptr && param_swapper_->on_disk(g)) param_swapper_->wait_read(g);
  return flat_->part(g);
}

void ZeroOptimizer::shard_done(size_t g) const {
  if (param_swapper_ != nullptr && param_swapper_->on_disk(g)) param_swapper_->release(g);
}

double ZeroOptimizer::param_gather_wait_seconds() const {
  return gather_clock_.seconds() + (stage3_ ? stage3_->gather_wait_seconds() : 0.0);
}

}  // namespace zero::partition
