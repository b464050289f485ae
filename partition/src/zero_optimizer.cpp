// The ZeRO optimizer: construction and the step loop (zero_optimizer.h).
#include "zero/partition/zero_optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/core/error.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/log.h"
#include "zero/core/trace.h"

namespace zero::partition {
namespace {

class GradReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(ZeroOptimizer* owner, size_t index) : owner_(owner), index_(index) {}
  void operator()(const torch::autograd::Variable& param) override {
    auto& grad = const_cast<torch::autograd::Variable&>(param).mutable_grad();
    if (!grad.defined()) return;
    const at::Tensor g = grad;
    grad.reset();  // the flat buffers hold it now (or, refused, nobody: no stale .grad for the next backward)
    owner_->on_grad_ready(index_, g);
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
  if (master_dtype(c) == at::kBFloat16) return at::kBFloat16;  // bf16 master weights "and grads"
  if (c.zero.stage == 3 && c.bf16.enabled) return at::kBFloat16;  // NOTE [16-bit gradients]
  return c.fp16.enabled ? at::kHalf : at::kFloat;
}

at::ScalarType master_dtype(const config::Config& c) {
  if (c.zero.stage < 1) return at::kFloat;
  if (c.bf16.enabled && c.bf16.bf16_master_weights_and_grads) return at::kBFloat16;
  if (c.fp16.enabled && c.fp16.fp16_master_weights_and_grads) return at::kHalf;
  return at::kFloat;
}

std::optional<at::ScalarType> communication_dtype(const config::Config& c) {
  if (!c.communication_data_type) return std::nullopt;
  return dtype_from_name(*c.communication_data_type);
}

MicsGroups make_mics_groups(Comm& world, int64_t shard) {
  const int n = world.world_size(), s = static_cast<int>(shard);
  ZERO_CHECK(s >= 1 && n % s == 0, "a MiCS shard group's size divides the world's");
  MicsGroups out;
  if (s == n) {
    out.partition = &world;
    return out;
  }
  const int first = world.rank() / s * s;
  std::vector<int> group(static_cast<size_t>(s)), replicas;
  std::iota(group.begin(), group.end(), first);
  for (int r = world.rank() % s; r < n; r += s) replicas.push_back(r);
  if (s > 1) out.shard = world.subgroup(group, "mics-shard");
  out.replica_group = world.subgroup(replicas, "mics-replicas");
  out.partition = out.shard.get();
  out.replicas = out.replica_group.get();
  return out;
}

ZeroOptimizer::ZeroOptimizer(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                             std::unique_ptr<optim::FlatOptimizer> optimizer,
                             ZeroOptimizerOptions options, MemoryLedger& ledger, Comm* comm, Comm* replicas)
    : options_(options),
      optimizer_(std::move(optimizer)),
      comm_(comm),
      replicas_(replicas),
      ledger_(ledger),
      copies_(options.device, options.copy_mode),
      gather_clock_(options.device) {
  ZERO_CHECK(optimizer_ != nullptr, "an optimizer is required");
  ZERO_CHECK(options_.stage >= 0 && options_.stage <= 2, "stage 0, 1 or 2 (stage 3 takes a Stage3Layout)");
  ZERO_CHECK(replicas == nullptr || options_.stage >= 2, "MiCS replicas at stages 2-3 (NOTE [MiCS])");
  if (comm_ != nullptr) {
    world_size_ = comm_->world_size();
    rank_ = comm_->rank();
  }
  grad_ranks_ = world_size_ * (replicas_ != nullptr ? replicas_->world_size() : 1);
  // Stage 0 replicates everything: its layout has one partition.
  const int64_t layout_ws = options_.stage == 0 ? 1 : world_size_;
  flat_ = std::make_unique<FlatParameters>(named_params, options_.compute_dtype, options_.device,
                                           layout_ws, options_.bucket_numel, ledger);
  init(nullptr);
}

ZeroOptimizer::ZeroOptimizer(Stage3Layout layout, std::unique_ptr<optim::FlatOptimizer> optimizer,
                             ZeroOptimizerOptions options, MemoryLedger& ledger, Comm* comm, Comm* replicas)
    : options_(options),
      optimizer_(std::move(optimizer)),
      comm_(comm),
      replicas_(replicas),
      ledger_(ledger),
      copies_(options.device, options.copy_mode),
      gather_clock_(options.device) {
  ZERO_CHECK(optimizer_ != nullptr, "an optimizer is required");
  ZERO_CHECK(options_.stage == 3, "a Stage3Layout is for stage 3");
  if (comm_ != nullptr) {
    world_size_ = comm_->world_size();
    rank_ = comm_->rank();
  }
  grad_ranks_ = world_size_ * (replicas_ != nullptr ? replicas_->world_size() : 1);
  if (layout.nvme_param) layout.offload_param = true;
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
  init(&layout);
  if (param_swapper_) {
    param_swapper_->swap_out();
    param_swapper_->clear_timings();
  }
  layout.options.shards_offloaded = layout.offload_param;
  layout.options.copy_mode = options_.copy_mode;
  stage3_ = Stage3Coordinator::create(*flat_, std::move(layout.units), layout.options, options_.device, comm_, ledger,
                                      param_swapper_.get());
  if (param_swapper_) param_swapper_->finish_a_gather = [this] { return stage3_->finish_a_gather(); };
  if (spec_) stage3_->set_before_gather([this] { spec_settle(); });
}

// The state store and the reducer, then the gradient hooks.
void ZeroOptimizer::init(Stage3Layout* layout) {
  if (options_.nvme) options_.offload_optimizer = true;
  ZERO_CHECK(!options_.offload_optimizer || options_.stage >= 1, "optimizer offload needs stage 1 or more");
  StoreOptions so;
  so.device = options_.device;
  so.offload = options_.offload_optimizer;
  so.pin_memory = options_.pin_memory;
  so.nvme = options_.nvme;
  so.ratio = options_.offload_ratio;
  so.max_in_cpu = options_.max_in_cpu;
  so.grads_on_device = options_.grads_on_device && options_.offload_optimizer && options_.stage >= 2;
  ZERO_CHECK(options_.offload_ratio == 1.0 || (options_.stage == 3 && options_.offload_optimizer &&
                                                 layout != nullptr && !layout->offload_param && !layout->nvme_param),
             "offload_optimizer.ratio < 1 is for stage 3 with optimizer offload and the shards on the device");
  so.sub_group_size = options_.sub_group_size;
  so.grad_partition = options_.stage >= 2;
  so.grad_dtype = options_.grad_accum_dtype;
  // NOTE [16-bit gradients]: stage 3's partition is in the accumulation
  // dtype on the host too.
  if (options_.stage == 3) so.host_grad_dtype = options_.grad_accum_dtype;
  so.master_dtype = options_.master_dtype;
  so.layout_rank = flat_->world_size() == 1 ? 0 : rank_;
  ZERO_CHECK(options_.master_dtype == at::kFloat || options_.master_dtype == options_.compute_dtype,
             "a 16-bit master is in the compute dtype");
  // The master is the parameters themselves when they are fp32 on the device
  // and not partitioned below stage 3 (one partition), or are stage 3's
  // shards on the device.
  StateStore::ParamMaster param_master;
  const bool fp32_on_device = options_.compute_dtype == at::kFloat && !options_.offload_optimizer &&
                              options_.master_dtype == at::kFloat;
  if (layout != nullptr) {
    if (fp32_on_device && !layout->nvme_param && flat_->part(0).device() == options_.device)
      param_master = [this](size_t g) { return flat_->part(g); };
  } else if (fp32_on_device && flat_->world_size() == 1) {
    param_master = [this](size_t g) { return flat_->chunk_of(flat_->flat(), g, 0); };
  }
  store_ = std::make_unique<StateStore>(*flat_, *optimizer_, so, ledger_, param_master);
  const int64_t layout_rank = flat_->world_size() == 1 ? 0 : rank_;
  store_->init(
      [&](size_t g) { return layout != nullptr ? shard(g) : flat_->chunk_of(flat_->flat(), g, layout_rank); },
      [&](size_t g) {
        if (layout != nullptr) shard_done(g);
      });

  ReductionOptions ro = options_.reduction;
  ro.device = options_.device;
  ro.accum_dtype = options_.grad_accum_dtype;
  ro.to_host = options_.offload_optimizer;
  ro.pin_memory = options_.pin_memory;
  reducer_ = GradientReducer::create(options_.stage, *flat_, *store_, comm_, ledger_, copies_, ro, replicas_);
  if (options_.super_offload) spec_init(layout);

  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(slots[i].param, std::make_unique<GradReadyHook>(this, i));
  }
}

ZeroOptimizer::~ZeroOptimizer() {
  if (spec_) {
    {
      std::lock_guard<std::mutex> lock(spec_->mu);
      spec_->stop = true;
    }
    spec_->cv.notify_all();
    if (spec_->worker.joinable()) spec_->worker.join();
  }
  for (const auto& slot : flat_->slots())
    torch::autograd::impl::set_post_acc_grad_hooks(slot.param, nullptr);
}

void ZeroOptimizer::begin_backward(bool boundary, const std::optional<PlannedStep>& planned) {
  if (spec_ && spec_->armed) spec_cancel();  // a boundary backward that never reached step()
  in_backward_ = true;
  if (boundary) store_->prefetch();  // NVMe: the step's first states arrive behind backward
  if (boundary && planned && spec_) {
    std::lock_guard<std::mutex> lock(spec_->mu);
    spec_->plan = *planned;
    spec_->combined = planned->loss_scale * average_factor();
    spec_->ready.clear();
    spec_->notified = 0;
    spec_->groups_done = 0;
    spec_->skip = false;
    spec_->error = nullptr;
    std::fill(spec_->stepped.begin(), spec_->stepped.end(), 0);
    spec_->armed = true;
    ++spec_counts_.planned;
  }
  reducer_->begin_backward(boundary);
}

void ZeroOptimizer::on_grad_ready(size_t index, const at::Tensor& grad) {
  if (!in_backward_) {  // NOTE [user backward]: a backward the program started itself
    ZERO_CHECK(on_user_backward_ != nullptr, "a gradient outside backward and no one to begin it");
    on_user_backward_();
    ZERO_CHECK(in_backward_, "a backward the program started was not begun");
  }
  reducer_->add(index, grad);
}

void ZeroOptimizer::end_backward() {
  in_backward_ = false;  // also when the reductions below throw: the next backward begins anew
  reducer_->end_backward();
  if (stage3_) stage3_->end_backward();
}

void ZeroOptimizer::abandon_backward() {
  try {
    reducer_->wait_all();  // collectives already launched finish before their buffers go
  } catch (const std::exception&) {  // the failure that abandoned the backward says more
  }
  in_backward_ = false;
  if (stage3_) stage3_->end_backward();
  if (spec_ && spec_->armed) spec_cancel();
  zero_grad();
}

void ZeroOptimizer::zero_grad() {
  // Gradients discarded after a speculative step used them: it is undone.
  if (spec_ && spec_->armed && !in_backward_) spec_cancel();
  reducer_->zero();
  for (const auto& slot : flat_->slots()) slot.param.mutable_grad().reset();
}

namespace {

// NOTE [gradient norm]
// The global norm sets the clip factor of every step, so it must not depend
// on how a stage lays the gradients out (buckets at stages 0-2, layers at 3,
// partitions across ranks): a norm summed in fp32 group by group differs in
// its last bits between layouts, the clip factor with it, and training
// drifts apart (bf16 at stage 3 from stage 0: 4e-2 in loss after 50 steps,
// identical with clipping off). Each element's square is exact in fp64 and
// their sum in fp64 is off by far less than fp32's resolution, where the
// factor is applied, so every layout clips alike. Σ x² of `g` in fp64, a
// piece at a time (no fp64 copy of a whole group).
at::Tensor sum_of_squares(const at::Tensor& g) {
  if (g.is_cpu() && g.is_contiguous()) {  // CPU Adam's kernel family, at memory speed
    if (g.scalar_type() == at::kFloat)
      return at::full({1}, optim::sum_of_squares_fp64(g.data_ptr<float>(), g.numel()), at::kDouble);
    if (g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf)
      return at::full({1},
                      optim::sum_of_squares_fp64(static_cast<const uint16_t*>(g.data_ptr()), g.numel(),
                                                 g.scalar_type() == at::kBFloat16),
                      at::kDouble);
  }
  constexpr int64_t kPiece = int64_t{1} << 22;
  at::Tensor acc = at::zeros({1}, g.options().dtype(at::kDouble));
  for (int64_t i = 0; i < g.numel(); i += kPiece)
    acc.add_(g.narrow(0, i, std::min(kPiece, g.numel() - i)).to(at::kDouble).square().sum());
  return acc;
}

}  // namespace

at::Tensor ZeroOptimizer::group_sum_of_squares(size_t g) const { return sum_of_squares(reducer_->owned(g)); }

StepOutcome ZeroOptimizer::step(const optim::StepParams& params, double loss_scale, double clip) {
  at::NoGradGuard no_grad;
  reducer_->before_step();
  StepOutcome out;
  const size_t n_groups = flat_->groups().size();
  // Sum of squares of the owned gradients, over the partition's ranks (NOTE
  // [MiCS]: every replica holds the same sums).
  // Gradients owned on the host (offloaded, on a GPU run) are summed there
  // and moved once: a scalar per group from pageable memory would make the
  // stream wait once per group.
  // NOTE [speculative step]: with a planned step, the worker has stepped
  // every sub-group and summed each group's squares as it went.
  const bool speculated = spec_ && spec_->armed;
  if (speculated) spec_wait();
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(options_.device));
  at::Tensor host_sumsq;
  for (size_t g = 0; g < n_groups; ++g) {
    // (The device's groups, NOTE [partial offload], are not speculated.)
    at::Tensor n = speculated && store_->on_host(g) ? spec_->sumsq[g] : group_sum_of_squares(g);
    if (n.device() == sumsq.device()) {
      sumsq.add_(n);
    } else {
      if (!host_sumsq.defined()) host_sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble));
      host_sumsq.add_(n.to(at::kCPU));
    }
  }
  if (host_sumsq.defined()) sumsq.add_(host_sumsq.to(options_.device));
  if (partitioned()) {
    const trace::Span span("wait", "wait for the gradient norm (all-reduce)");
    comm_->all_reduce_sum(sumsq).wait();
  }
  const double total_sumsq = sumsq.item<double>();
  // Reductions summed over ranks after the pre-scale: the rest of the
  // average (NOTE [gradient path]) joins the unscale.
  const double scale_total = loss_scale * average_factor();
  out.grad_norm = std::sqrt(total_sumsq) / scale_total;
  if (!std::isfinite(total_sumsq) && options_.check_overflow) {
    if (speculated) {
      spec_restore(/*rewrite_values=*/true);
      ++spec_counts_.undone;
    }
    zero_grad();
    return out;
  }
  double combined = scale_total;  // DeepSpeed's unscale_and_clip_grads: one factor
  if (clip > 0) {
    const double ratio = (out.grad_norm + 1e-6) / clip;
    if (ratio > 1) combined *= ratio;
  }
  if (speculated) {
    const PlannedStep& plan = spec_->plan;
    const bool as_planned = combined == spec_->combined && plan.clip == clip && plan.params.step == params.step &&
                            plan.params.lr == params.lr && plan.params.beta1 == params.beta1 &&
                            plan.params.beta2 == params.beta2 && plan.params.weight_decay == params.weight_decay;
    if (as_planned) {
      {
        const trace::Span span("optimizer", "speculative step validated");
        // As write_pass ends: what the next forward reads has arrived.
        spec_->last.block_current();
        spec_->last = StreamEvent();
        {
          std::lock_guard<std::mutex> lock(spec_->mu);
          spec_->armed = false;
        }
      }
      // NOTE [partial offload]: the device's groups step now, with the
      // factor known (which write_pass ends with after_step).
      const auto& sgs = store_->sub_groups();
      if (std::any_of(sgs.begin(), sgs.end(), [&](const SubGroup& sg) { return !store_->on_host(sg.group); }))
        write_pass(
            [&](size_t k, at::Tensor& m, std::vector<at::Tensor>& s, LowOut& low) {
              const auto [g, start, len] = sgs[k];
              step_sub_group(k, reducer_->owned(g).narrow(0, start, len), m, s, low, params, combined);
            },
            /*device_only=*/true);
      else if (stage3_)
        stage3_->after_step();
      ++spec_counts_.validated;
      zero_grad();
      out.applied = true;
      return out;
    }
    // Clipped (or a step other than planned): from the states as they were.
    spec_restore(/*rewrite_values=*/false);
    ++spec_counts_.redone;
  }
  // NOTE [offload transfers]: gradients on the device (stage 1's, a
  // partition kept there) come to the host a piece ahead of the CPU pass.
  const auto& sub_groups = store_->sub_groups();
  const int64_t piece = value_piece();
  GradFetch fetch(grad_ring_, copies_, copy_wait_s_);
  std::optional<at::ScalarType> fetched_dtype;  // the gradients' on the device (the partition's: NOTE [device gradients])
  for (size_t k = 0; k < sub_groups.size(); ++k) {
    const auto [g, start, len] = sub_groups[k];
    if (!grad_fetched(g)) continue;
    const at::Tensor grad = reducer_->owned(g).narrow(0, start, len);
    fetched_dtype = grad.scalar_type();
    for (int64_t a = 0; a < len; a += std::min(piece, len)) fetch.plan(k, a, std::min({piece, len, len - a}), grad);
  }
  if (fetched_dtype && !grad_ring_.defined()) {
    int64_t largest = 1;
    for (const auto& sg : sub_groups) largest = std::max(largest, sg.numel);
    grad_ring_ = HostRing(ledger_, options_.pin_memory, 2, std::min(piece, largest), *fetched_dtype,
                          "gradients for the host");
  }
  write_pass([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& s, LowOut& low) {
    const auto [g, start, len] = sub_groups[k];
    step_sub_group(k, reducer_->owned(g).narrow(0, start, len), m, s, low, params, combined, nullptr, nullptr,
                   grad_fetched(g) ? &fetch : nullptr);
  });
  zero_grad();
  out.applied = true;
  return out;
}

void ZeroOptimizer::step_sub_group(size_t k, const at::Tensor& grad, at::Tensor& m, std::vector<at::Tensor>& s,
                                   LowOut& low, const optim::StepParams& params, double combined,
                                   const std::vector<at::Tensor>* undo, int64_t* undo_saved, GradFetch* fetch) {
  const auto [g, start, len] = store_->sub_groups()[k];
  const auto& specs = store_->state_specs();
  const int64_t layout_rank = flat_->world_size() == 1 ? 0 : rank_;
  const int64_t piece_cap = value_piece();
  std::vector<optim::FlatOptimizer::Run> runs;  // each run of one parameter group with its values
  if (runs_.empty()) {
    runs.push_back({0, len, params});
  } else {
    for (const Run& r : runs_[k]) {
      optim::StepParams p = params;
      const GroupHyper& h = groups_[r.group];
      if (h.lr_set) p.lr = *h.lr_set;  // Engine::set_lr's, until the schedule's next step
      else if (h.lr) p.lr = base_lr_ > 0 ? params.lr * (*h.lr / base_lr_) : *h.lr;
      p.weight_decay = h.weight_decay;
      runs.push_back({r.start, r.numel, p});
    }
  }
  // A piece at a time: where the new values go through the host ring
  // (write_pass), and at most host_staging_numel elements anyway, so a
  // 16-bit gradient's fp32 copy is one piece, not the sub-group (a whole
  // partition at the default sub_group_size). Each piece's runs and states
  // are its own slices (a block-wise state's blocks: pieces start on block
  // boundaries).
  const int64_t step = std::min(low.wanted() ? low.max_piece() : len, piece_cap);
  ZERO_CHECK(fetch == nullptr || (undo == nullptr && std::min(step, len) == std::min(piece_cap, len)),
             "a fetched gradient comes in the step's pieces");
  for (const auto& spec : specs)
    ZERO_CHECK(spec.per_block == 0 || step >= len || step % spec.per_block == 0,
               "a write pass's pieces must start on the optimizer states' block boundaries");
  // The update of elements [a, a + n) of the sub-group, its new values into `pl` (or none).
  auto update = [&](int64_t a, int64_t n, at::Tensor* pl) {
    const std::vector<optim::FlatOptimizer::Run> piece_runs = optim::runs_within(runs, a, n);
    // Gradients in host memory for the CPU pass (fp32, bf16, fp16) are
    // unscaled inside it, 16-bit ones widened there too (NOTE [16-bit
    // gradients]): never a pass of its own over memory (ATen's took 2x the
    // Adam pass here, benchmarks/RESULTS.md), and the gradient stays as it
    // was (a speculative step's redo reads it again). On a device: unscaled
    // in place, or through this piece's fp32 copy.
    const at::Tensor gp = fetch != nullptr ? fetch->take(k, a, n) : n == len ? grad : grad.narrow(0, a, n);
    const at::ScalarType gt = gp.scalar_type();
    const bool in_pass = m.is_cpu() && gp.is_cpu() && gp.is_contiguous() &&
                         (gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf);
    at::Tensor g32 = in_pass ? gp : gp.to(m.device(), at::kFloat);
    if (combined != 1.0 && !in_pass) g32.mul_(1.0 / combined);
    at::Tensor pm = n == len ? m : m.narrow(0, a, n);
    std::vector<at::Tensor> ps;
    // (8-bit Adam's side states only where the sub-group has fp32 blocks:
    // without them the step never reads its scales back from a device.)
    for (size_t i = 0; i < s.size(); ++i)
      if (!specs[i].side || !store_->fp32_blocks(k).empty())
        ps.push_back(n == len ? s[i] : optim::state_window(specs[i], s[i], a, n));
    // A 16-bit master's random words follow the flat index (NOTE [16-bit master]).
    const auto& grp = flat_->groups()[g];
    const optim::Rounding rounding{options_.stochastic_rounding,
                                   static_cast<uint64_t>(grp.begin + layout_rank * grp.chunk_numel + start + a),
                                   params.step};
    // ATen's mul_(1.0 / combined) multiplies in fp32 by the factor rounded to fp32.
    const float grad_mul = in_pass && combined != 1.0 ? static_cast<float>(1.0 / combined) : 1.0f;
    optim::update_stored(*optimizer_, piece_runs, pm, g32, ps, pl, rounding, grad_mul);
  };
  // NOTE [speculative step]: with `undo`, each window of kUndoWindow
  // elements is copied there just before its update, while it is in cache
  // (a block-wise side state, which every window reads whole, first);
  // windows start on the 8-bit blocks' boundaries, and the update of
  // separate windows is that of the whole, element by element.
  constexpr int64_t kUndoWindow = int64_t{1} << 16;
  if (undo != nullptr) {
    for (size_t i = 0; i < s.size(); ++i)
      if (specs[i].side) (*undo)[i + 1].copy_(s[i]);
    if (undo_saved != nullptr) *undo_saved = 0;
  }
  for (int64_t a = 0; a < len; a += step) {
    const int64_t n = std::min(step, len - a);
    at::Tensor pl = low.wanted() ? low.piece(a, n) : at::Tensor();
    if (undo == nullptr) {
      update(a, n, low.wanted() ? &pl : nullptr);
    } else {
      for (int64_t w = a; w < a + n; w += kUndoWindow) {
        const int64_t c = std::min(kUndoWindow, a + n - w);
        (*undo)[0].narrow(0, w, c).copy_(m.narrow(0, w, c));
        for (size_t i = 0; i < s.size(); ++i)
          if (!specs[i].side) optim::state_window(specs[i], (*undo)[i + 1], w, c).copy_(optim::state_window(specs[i], s[i], w, c));
        if (undo_saved != nullptr) *undo_saved = w + c;
        at::Tensor plw = low.wanted() ? pl.narrow(0, w - a, c) : at::Tensor();
        update(w, c, low.wanted() ? &plw : nullptr);
      }
    }
    if (low.wanted()) low.done();
  }
}

bool ZeroOptimizer::grad_fetched(size_t g) const {
  return store_->offloaded() && store_->on_host(g) && (!reducer_->owned_in_store() || !store_->grad_on_host(g));
}

at::Tensor ZeroOptimizer::GradFetch::take(size_t k, int64_t a, int64_t n) {
  while (next_ < order_.size() && ahead_.size() < 2) {
    const Piece& p = order_[next_++];
    at::Tensor host = ring_.next(p.n, wait_s_);
    StreamEvent done = copies_.copy(host, p.src.narrow(0, p.a, p.n));
    ring_.used_by(done);
    ahead_.emplace_back(host, done);
  }
  const size_t at = next_ - ahead_.size();  // the piece at the front
  ZERO_CHECK(!ahead_.empty() && order_[at].k == k && order_[at].a == a && order_[at].n == n,
             "a fetched gradient taken out of its order");
  auto [host, done] = std::move(ahead_.front());
  ahead_.pop_front();
  const auto t0 = std::chrono::steady_clock::now();
  done.synchronize();
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return host;
}

void ZeroOptimizer::set_param_groups(std::vector<GroupHyper> groups, const std::vector<size_t>& group_of) {
  ZERO_CHECK(!groups.empty() && group_of.size() == flat_->slots().size(), "a group for every parameter");
  groups_ = std::move(groups);
  group_of_ = group_of;
  base_lr_ = optimizer_->config().lr;
  runs_.clear();
  const int64_t layout_rank = flat_->world_size() == 1 ? 0 : rank_;
  for (const auto& sg : store_->sub_groups()) {
    const auto& grp = flat_->groups()[sg.group];
    // The sub-group's elements of the flat buffer, and each parameter's share of them.
    const int64_t lo = grp.begin + layout_rank * grp.chunk_numel + sg.start, hi = lo + sg.numel;
    int64_t at = 0;
    std::vector<size_t> slots(grp.slots.begin(), grp.slots.end());
    std::sort(slots.begin(), slots.end(), [&](size_t a, size_t b) { return flat_->slots()[a].offset < flat_->slots()[b].offset; });
    std::vector<Run> runs;
    auto add = [&](int64_t b, int64_t e, size_t group) {
      if (e <= b) return;
      if (!runs.empty() && runs.back().group == group && runs.back().start + runs.back().numel == b)
        runs.back().numel += e - b;
      else
        runs.push_back({b, e - b, group});
    };
    for (size_t i : slots) {
      const auto& slot = flat_->slots()[i];
      const int64_t b = std::max(lo, slot.offset), e = std::min(hi, slot.offset + slot.numel);
      if (e <= b) continue;
      add(at, b - lo, 0);  // padding before it
      add(b - lo, e - lo, group_of_[i]);
      at = e - lo;
    }
    add(at, sg.numel, 0);
    runs_.push_back(std::move(runs));
  }
}

std::vector<int64_t> ZeroOptimizer::param_group_numels() const {
  std::vector<int64_t> out(groups_.empty() ? 1 : groups_.size(), 0);
  for (size_t i = 0; i < flat_->slots().size(); ++i) out[group_of_.empty() ? 0 : group_of_[i]] += flat_->slots()[i].numel;
  return out;
}

at::Tensor ZeroOptimizer::LowOut::piece(int64_t start, int64_t len) {
  ZERO_CHECK(wanted() && len <= max_piece_ && start + len <= out_.numel(), "a write pass's piece out of its sub-group");
  start_ = start;
  len_ = len;
  if (mode_ == Mode::kInPlace) return out_.narrow(0, start, len);
  host_ = ring_->next(len, *wait_s_);
  return host_;
}

void ZeroOptimizer::LowOut::done() {
  if (mode_ != Mode::kToDevice) return;
  *group_last_ = *last_ = copies_->copy(out_.narrow(0, start_, len_), host_, /*host_source=*/true);
  ring_->used_by(*group_last_);
  host_ = at::Tensor();
}

int64_t ZeroOptimizer::value_piece() const {
  constexpr int64_t kBlock = 256;  // pieces start on 8-bit states' block boundaries (NOTE [8-bit states])
  return std::max<int64_t>(kBlock, options_.reduction.host_staging_numel / kBlock * kBlock);
}

HostRing ZeroOptimizer::make_value_ring(const std::string& what) {
  int64_t largest = 1;
  for (const auto& sg : store_->sub_groups()) largest = std::max(largest, sg.numel);
  return HostRing(ledger_, options_.pin_memory, 2, std::min(value_piece(), largest), options_.compute_dtype, what);
}

ZeroOptimizer::LowOut ZeroOptimizer::to_device(const at::Tensor& out, int64_t piece, HostRing& ring,
                                               CopyStream& copies, double& wait_s, StreamEvent& last,
                                               StreamEvent& group_last) {
  LowOut low;
  low.ring_ = &ring;
  low.copies_ = &copies;
  low.wait_s_ = &wait_s;
  low.out_ = out;
  low.mode_ = LowOut::Mode::kToDevice;
  low.max_piece_ = piece;
  low.last_ = &last;
  low.group_last_ = &group_last;
  return low;
}

void ZeroOptimizer::write_values_of(const at::Tensor& m, LowOut& low) {
  for (int64_t a = 0; a < m.numel(); a += low.max_piece()) {
    const int64_t n = std::min(low.max_piece(), m.numel() - a);
    low.piece(a, n).copy_(m.narrow(0, a, n));
    low.done();
  }
}

// A pass over the store's sub-groups that changes the masters (the step, a
// load) and brings the model's parameters up to date: `body` updates sub-group
// k's master and states and writes the new values, in the compute dtype,
// through `low` a piece at a time (to where the model reads them: its own
// chunk at one partition, a buffer this rank's chunk is all-gathered from,
// stage 3's shard; to a pinned buffer on its way to the device when
// offloaded, NOTE [offload transfers]); `low` is not wanted when the master
// is the parameters themselves.
void ZeroOptimizer::write_pass(const WriteBody& body, bool device_only) {
  const trace::Span span("optimizer", "write the new parameters (step or load)");
  const size_t n_groups = flat_->groups().size();
  std::vector<at::Tensor> outs(n_groups);
  // A shard on disk gets its buffer when its first values are ready.
  auto on_disk = [&](size_t g) { return param_swapper_ != nullptr && param_swapper_->on_disk(g); };
  if (stage3_) {
    // Shards in host memory are written below: the copies out of them end first.
    for (size_t g = 0; g < n_groups; ++g)
      if (!on_disk(g)) stage3_->wait_shard_copies(g);
  }
  for (size_t g = 0; g < n_groups && !store_->master_is_param(); ++g) {
    if (stage3_) {
      if (!on_disk(g)) outs[g] = flat_->part(g);
    } else {
      outs[g] = partitioned() ? at::empty({flat_->groups()[g].chunk_numel},
                                          at::TensorOptions().dtype(options_.compute_dtype).device(options_.device))
                              : flat_->chunk_of(flat_->flat(), g, 0);
    }
  }
  // The new values of a device-side destination pass through pinned buffers
  // (not when stage 3 keeps its shards in host memory: they are written in
  // place), a piece of at most host_staging_numel elements at a time, so the
  // ring holds two pieces, not two sub-groups (NOTE [offload transfers]).
  // (The device's groups of a partial offload are written in place: NOTE [partial offload].)
  const bool values_to_device = store_->offloaded() && !(stage3_ && stage3_->shards_offloaded());
  const auto& sub_groups = store_->sub_groups();
  const int64_t piece = value_piece();
  bool any_host = false;
  for (size_t g = 0; g < n_groups; ++g) any_host = any_host || (store_->on_host(g) && !device_only);
  if (values_to_device && any_host && !param_ring_.defined())
    param_ring_ = make_value_ring("parameters for the device");
  std::vector<StreamEvent> group_copies(n_groups);  // per group: its last copy of new values
  StreamEvent last_to_device;                     // of all groups (one stream: the others end before it)
  std::vector<CommWork> gathers;
  auto group_done = [&](size_t g) {
    if (on_disk(g) && outs[g].defined()) {  // the new shard goes back to disk
      param_swapper_->end_update(g);
      outs[g] = at::Tensor();
    }
    if (!partitioned() || stage3_) return;
    group_copies[g].block_current();  // the all-gather sends what the copies brought
    at::Tensor range = flat_->group_of(flat_->flat(), g);
    gathers.push_back(comm_->all_gather(range, outs[g]));
  };
  store_->visit(/*write_back=*/true, [&](size_t k, at::Tensor m, std::vector<at::Tensor> s) {
    const auto [g, start, len] = sub_groups[k];
    const bool host = store_->on_host(g);
    if (device_only && host) return;
    if (on_disk(g) && !outs[g].defined()) outs[g] = param_swapper_->begin_update(g);
    LowOut low;
    if (outs[g].defined()) {
      low = to_device(outs[g].narrow(0, start, len), piece, param_ring_, copies_, copy_wait_s_, last_to_device,
                      group_copies[g]);
      if (!values_to_device || !host) {  // written in place, the sub-group at once
        low.mode_ = LowOut::Mode::kInPlace;
        low.max_piece_ = len;
      }
    }
    {
      const trace::Span span("optimizer", host ? "CPU step of a sub-group" : "step of a sub-group",
                             static_cast<int64_t>(k));
      body(k, m, s, low);
    }
    if (k + 1 == sub_groups.size() || sub_groups[k + 1].group != g) group_done(g);
  });
  for (auto& w : gathers) gather_clock_.time([&] { w.wait(); }, "wait for new parameters");
  // What the next forward (and stage 3's regathering) reads must have arrived:
  // the compute stream waits for the copies, in stream order the last of them.
  last_to_device.block_current();
  if (stage3_) stage3_->after_step();
}

void ZeroOptimizer::read_states(const StateStore::Visit& fn) {
  at::NoGradGuard no_grad;
  spec_settle();  // the states as they were before a speculation (NOTE [speculative step])
  reducer_->wait_all();
  store_->visit(/*write_back=*/false, fn);
}

void ZeroOptimizer::load_states(const PassBody& fill) {
  at::NoGradGuard no_grad;
  zero_grad();
  write_pass([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& s, LowOut& low) {
    fill(k, m, s, nullptr);
    if (low.wanted()) write_values_of(m, low);  // the parameters as the step would have left them
  });
}

// In double, group by group (a group at a time bounds the temporary), so two
// layouts of the same values give the same norm to about 1e-15.
double ZeroOptimizer::parameter_l2() const {
  // The shards as they were before a speculation (NOTE [speculative step]):
  // undoing one changes no value this object is asked for.
  const_cast<ZeroOptimizer*>(this)->spec_settle();
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(options_.device));
  for (size_t g = 0; g < flat_->groups().size(); ++g) {
    const at::Tensor values = flat_->stage3() ? shard(g) : flat_->group_of(flat_->flat(), g);
    // A piece at a time in fp64 (NOTE [gradient norm]): no fp64 copy of a
    // group, which a run near its memory budget lacks.
    sumsq.add_(sum_of_squares(values).to(options_.device));
    if (flat_->stage3()) shard_done(g);
  }
  // Stage 3: each rank has its shards; padding is zero.
  if (flat_->stage3() && comm_ != nullptr && world_size_ > 1) {
    const trace::Span span("wait", "wait for the parameter norm (all-reduce)");
    comm_->all_reduce_sum(sumsq).wait();
  }
  return std::sqrt(sumsq.item<double>());
}

void ZeroOptimizer::set_values(const std::map<size_t, ChunkUpdate>& chunks) {
  at::NoGradGuard no_grad;
  spec_settle();  // NOTE [speculative step]: the values as they stand
  const auto& sub_groups = store_->sub_groups();
  for (const auto& [g, c] : chunks)
    ZERO_CHECK(g < flat_->groups().size() && c.values.numel() == flat_->groups()[g].chunk_numel,
               "set_values: not a chunk");
  write_pass([&](size_t k, at::Tensor& m, std::vector<at::Tensor>&, LowOut& low) {
    const auto [g, start, len] = sub_groups[k];
    if (auto it = chunks.find(g); it != chunks.end()) {
      const at::Tensor v = it->second.values.reshape({-1}).narrow(0, start, len).to(m.options());
      const at::Tensor mask = it->second.mask.narrow(0, start, len).to(m.device());
      m.copy_(at::where(mask, v, m));
    }
    if (low.wanted()) write_values_of(m, low);
  });
}

void ZeroOptimizer::write_frozen_shard(size_t g, const at::Tensor& values) {
  ZERO_CHECK(stage3_ != nullptr && g < flat_->all_groups().size() && flat_->all_groups()[g].frozen,
             "write_frozen_shard: not a frozen group");
  ZERO_CHECK(values.numel() == flat_->all_groups()[g].chunk_numel, "write_frozen_shard: not a chunk of the group");
  at::NoGradGuard no_grad;
  stage3_->shards_changed(g);  // after any gather's copy out of the shard
  const bool swapped = param_swapper_ != nullptr && param_swapper_->on_disk(g);
  // Converted first: nothing can fail between begin_update and end_update.
  const at::Tensor v = values.reshape({-1}).to(flat_->part(g).options(), /*non_blocking=*/false, /*copy=*/false);
  const at::Tensor& part = swapped ? param_swapper_->begin_update(g) : flat_->part(g);
  part.copy_(v);
  if (swapped) param_swapper_->end_update(g);
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
