#include "zero/core/ledger_alloc.h"
#include "zero/partition/stage3.h"

#include <chrono>
#include <numeric>
#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "zero/core/error.h"
#include "zero/core/trace.h"
#include "zero/core/log.h"

namespace zero::partition {
namespace {

constexpr const char* kLayerTag = "_zero_stage3_layer";

// The mark a coordinator leaves on each of its layers (NOTE [stage-3 layers]).
class LayerTagImpl : public torch::nn::Module {
 public:
  LayerTagImpl(std::weak_ptr<Stage3Coordinator> coordinator, size_t unit)
      : coordinator_(std::move(coordinator)), unit_(unit) {}
  LayerHandle handle() const { return {coordinator_.lock(), unit_}; }

 private:
  std::weak_ptr<Stage3Coordinator> coordinator_;
  size_t unit_;
};

}  // namespace

LayerHandle find_layer(const torch::nn::Module& module) {
  const auto children = module.named_children();
  const auto* tag = children.find(kLayerTag);
  if (tag == nullptr) return {};
  const auto* t = dynamic_cast<const LayerTagImpl*>(tag->get());
  return t == nullptr ? LayerHandle{} : t->handle();
}

std::shared_ptr<Stage3Coordinator> Stage3Coordinator::create(FlatParameters& params, std::vector<Stage3Unit> units,
                                                              Stage3Options options, at::Device device, Comm* comm,
                                                              MemoryLedger& ledger, ParamSwapper* swapper) {
  auto c = std::make_shared<Stage3Coordinator>(params, std::move(units), options, device, comm, ledger, swapper);
  for (const auto& u : c->units_) {
    if (find_layer(*u.module).coordinator != nullptr || u.module->named_children().find(kLayerTag) != nullptr)
      throw UsageError("stage 3: layer " + u.name + " is already a layer of another live engine; one engine per model");
  }
  for (size_t i = 0; i < c->units_.size(); ++i)
    c->units_[i].module->register_module(kLayerTag, std::make_shared<LayerTagImpl>(c, i));
  // NOTE [ungathered use]: the layers' parameters (group 0's are always gathered).
  std::unordered_map<const c10::TensorImpl*, UngatheredUseCheck::Param> watched;
  const auto& slots = c->params_.all_slots();
  for (size_t g = 1; g < c->params_.all_groups().size(); ++g)
    for (size_t s : c->params_.all_groups()[g].slots)
      watched.emplace(slots[s].param.unsafeGetTensorImpl(),
                      UngatheredUseCheck::Param{slots[s].name, c->params_.all_groups()[g].name});
  c->use_check_ = std::make_unique<UngatheredUseCheck>(std::move(watched));
  return c;
}

Stage3Coordinator::Stage3Coordinator(FlatParameters& params, std::vector<Stage3Unit> units,
                                     Stage3Options options, at::Device device, Comm* comm, MemoryLedger& ledger,
                                     ParamSwapper* swapper)
    : params_(params),
      units_(std::move(units)),
      forward_span_(units_.size()),
      backward_span_(units_.size()),
      options_(options),
      device_(device),
      comm_(comm),
      ledger_(ledger),
      swapper_(swapper),
      stream_(device, options.copy_mode),
      clock_(device) {
  ZERO_CHECK(params_.stage3(), "the stage-3 coordinator needs stage-3 parameters");
  if (comm_ != nullptr) world_size_ = comm_->world_size();
  const int64_t k = options_.hpz_partition_size;
  if (k > 1 && world_size_ > 1) {
    // NOTE [hpZ]: groups of k consecutive ranks.
    if (world_size_ % k != 0) {
      throw ConfigError({"zero_optimization.zero_hpz_partition_size: expected a divisor of the world size " +
                         std::to_string(world_size_) + " (the ranks of a node); got " + std::to_string(k)});
    }
    const int first = static_cast<int>(comm_->rank() / k * k);
    std::vector<int> ranks(static_cast<size_t>(k));
    std::iota(ranks.begin(), ranks.end(), first);
    hpz_comm_ = comm_->subgroup(ranks, "hpz");
  }
  if (options_.hierarchical_gather && world_size_ > 1) make_hierarchy();
  groups_.resize(params_.all_groups().size());
  for (size_t u = 0; u < units_.size(); ++u)
    for (size_t g : units_[u].groups) ZERO_CHECK(g > 0 && g < groups_.size(), "unit group out of range");
  issue(0, false);
  wait(0);
}

Stage3Coordinator::~Stage3Coordinator() {
  for (const auto& u : units_) {
    const auto children = u.module->named_children();
    const auto* tag = children.find(kLayerTag);
    if (tag == nullptr) continue;
    const auto* t = dynamic_cast<const LayerTagImpl*>(tag->get());
    // Only its own marks (a throwing create() leaves others' alone).
    if (t != nullptr && t->handle().coordinator == nullptr) u.module->unregister_module(kLayerTag);
  }
}

// Issues group g's all-gather into its full tensor (NOTE [stage-3 storage]).
// With a parameter swapper the gather is queued and its shard's read starts
// now; queued gathers are launched in issue order when one of them is waited
// for, or at the next layer event, whichever comes first, so a prefetched
// shard has a layer's time to arrive. Launch points depend on the events
// only, never on when a read finishes: every rank launches its collectives
// in the same order (NOTE [parameter swapping]).
void Stage3Coordinator::issue(size_t g, bool prefetch, bool exact) {
  auto& grp = groups_[g];
  ZERO_CHECK(grp.state == State::kReleased, "group gathered twice");
  const auto& info = params_.all_groups()[g];
  const at::Tensor& full = params_.full(g);
  const int64_t nbytes = full.numel() * static_cast<int64_t>(full.element_size());
  const std::string name = info.name.empty() ? std::string("group 0") : info.name;
  grp.bytes = LedgerAlloc::reserve(ledger_, Tier::kDevice, kind_of(g), nbytes,
                                   std::string(info.frozen ? "gathered frozen parameters of " : "gathered parameters of ") + name);
  set_storage_bytes(full, static_cast<size_t>(nbytes));
  const bool collective = world_size_ > 1 && comm_ != nullptr;
  // NOTE [hpZ]: the node's copy holds what the last gather brought, which an
  // exact gather takes only when that one was exact.
  grp.from_secondary = collective && grp.secondary.defined() && !(exact && grp.secondary_quantized);
  // NOTE [quantized gather]: layers only; group 0 is gathered once a step, exact.
  grp.quantized = collective && options_.quantize_weights && g != 0 && !exact && !grp.from_secondary;
  if (grp.quantized) {
    const int64_t payload = quantized_payload_bytes(params_.all_groups()[g].chunk_numel, options_.quant_block);
    grp.buffer_bytes = LedgerAlloc::reserve(ledger_, Tier::kDevice, Kind::kCommBuffers, payload * (world_size_ + 1),
                                            "quantized gather (qwZ) of " + name);
  }
  grp.state = State::kInFlight;
  grp.launched = false;
  grp.prefetched = prefetch;
  if (g != 0) {
    live_ += numel(g);
    peak_live_ = std::max(peak_live_, live_);
  }
  ++gathers_;
  if (prefetch) ++prefetched_;
  if (swapper_ != nullptr && !grp.from_secondary) {
    swapper_->start_read(g, /*may_wait=*/true);
    swapper_->hold(g);  // a queued gather's shard is not dropped for another read
  }
  // NOTE [stage-3 trace]: the ranks' group ids; checked before the launch
  // where ranks may disagree, else before the values are used.
  if (world_size_ > 1 && comm_ != nullptr)
    grp.check = comm_->start_exchange(static_cast<int64_t>(g), "stage-3 check of the layer gathered (" + describe(g) + ")");
  grp.check_first = exact || !trusted_ || !(in_backward_ || at::GradMode::is_enabled());
  unlaunched_.push_back(g);
  if (swapper_ == nullptr) launch_queued(g);  // nothing to read: at once, as ever
}

// Launches queued gathers in issue order, waiting for their shards: all of
// them, or up to and including `until`.
void Stage3Coordinator::launch_queued(std::optional<size_t> until) {
  while (!unlaunched_.empty()) {
    const size_t g = unlaunched_.front();
    unlaunched_.pop_front();
    launch(g);
    if (until && *until == g) return;
  }
}

// NOTE [stage-3 gather stream].
void Stage3Coordinator::launch(size_t g) {
  if (before_gather_) before_gather_();
  const trace::Span span("gather", [&] { return "gather " + describe(static_cast<int64_t>(g)); }, static_cast<int64_t>(g));
  auto& grp = groups_[g];
  const at::Tensor& full = params_.full(g);
  // offload_param: the partition lives in host memory (or on disk, read by
  // now); the copy to the device is part of the gather.
  if (swapper_ != nullptr && !grp.from_secondary) {
    const auto t0 = std::chrono::steady_clock::now();
    swapper_->wait_read(g);
    read_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const at::Tensor& chunk = params_.part(g);
  const bool from_host = options_.shards_offloaded || chunk.device() != device_;
  if (world_size_ == 1 || comm_ == nullptr) {
    grp.done = stream_.copy(full, chunk, /*host_source=*/from_host);  // the gather of one rank
    if (from_host) grp.shard_copy = grp.done;
  } else {
    // Paired with an exchange of the group's id, started when it was issued
    // (NOTE [stage-3 trace]).
    if (grp.check_first) check_pairing(g);
    grp.done = stream_.run([&] { launch_collective(g, chunk, from_host); });
  }
  grp.launched = true;
}

// Group g's all-gather, on the gather stream: from the node's copy (hpZ),
// or from the shard, quantized (qwZ) or not.
void Stage3Coordinator::launch_collective(size_t g, const at::Tensor& chunk, bool from_host) {
  auto& grp = groups_[g];
  at::Tensor out = params_.full(g);
  if (grp.from_secondary) {
    grp.send = grp.secondary;
    grp.work = hpz_comm_->all_gather(out, grp.send);
    return;
  }
  if (from_host) {
    grp.send = at::empty({chunk.numel()}, out.options());
    grp.shard_copy = stream_.copy(grp.send, chunk, /*host_source=*/true);
    grp.shard_copy.block_current();  // on the CPU (kDeferred), the copy happens here
  } else {
    grp.send = chunk;
  }
  if (!grp.quantized) {
    all_gather(g, out, grp.send);
    return;
  }
  const int64_t payload = quantized_payload_bytes(chunk.numel(), options_.quant_block);
  at::Tensor codes = at::empty({payload}, out.options().dtype(at::kByte));
  quantize_shard(grp.send, codes, options_.quant_block);
  grp.send = codes;
  grp.received = at::empty({payload * world_size_}, codes.options());
  all_gather(g, grp.received, grp.send);
}

void Stage3Coordinator::all_gather(size_t g, at::Tensor& out, const at::Tensor& in) {
  auto& grp = groups_[g];
  if (across_comm_ == nullptr) {
    grp.work = comm_->all_gather(out, in);
    return;
  }
  // NOTE [hierarchical gather].
  // The first hop is waited for here: the ranks' ids first, so that ranks
  // gathering different layers fail naming them, not inside a hop of
  // mismatched sizes.
  check_pairing(g);
  const int64_t c = in.numel(), m = across_comm_->world_size(), l = within_comm_->world_size();
  grp.staged = LedgerAlloc::empty(ledger_, m * c, in.scalar_type(), in.device(), Tier::kDevice, Kind::kCommBuffers,
                                  "hierarchical gather's shards from the other nodes");
  CommWork across = across_comm_->all_gather(grp.staged, in);
  across.wait();
  for (int64_t j = 0; j < m; ++j) {
    at::Tensor block = out.narrow(0, j * l * c, l * c);
    grp.hops.push_back(within_comm_->all_gather(block, grp.staged.narrow(0, j * c, c)));
  }
}

void Stage3Coordinator::make_hierarchy() {
  const std::vector<int> nodes = comm_->nodes();  // the same on every rank: so is the decision
  const int s = static_cast<int>(nodes.size());
  int per_node = 1;
  while (per_node < s && nodes[static_cast<size_t>(per_node)] == nodes[0]) ++per_node;
  bool blocks = s % per_node == 0;
  std::set<int> seen;
  for (int b = 0; blocks && b < s; b += per_node) {
    const int node = nodes[static_cast<size_t>(b)];
    blocks = seen.insert(node).second;
    for (int r = b; blocks && r < b + per_node; ++r) blocks = nodes[static_cast<size_t>(r)] == node;
  }
  if (!blocks || per_node == s || per_node == 1) {
    if (comm_->rank() == 0)  // (each shard group's first rank)
      log::info(std::string("zero_optimization.mics_hierarchical_params_gather: ") +
                (per_node == s   ? "the ranks that partition the layers are on one node"
                 : per_node == 1 ? "the ranks that partition the layers are one a node (the gather across the nodes "
                                   "is the whole gather)"
                                 : "the ranks that partition the layers are not in blocks of equal size, one a node") +
                "; their gathers go in one hop");
    return;
  }
  const int me = comm_->rank(), across_n = s / per_node;
  std::vector<int> across, within;
  for (int j = 0; j < across_n; ++j) across.push_back(me % per_node + j * per_node);
  for (int i = 0; i < per_node; ++i) within.push_back(me / per_node * per_node + i);
  across_comm_ = comm_->subgroup(across, "mics-across");
  within_comm_ = comm_->subgroup(within, "mics-within");
}

void Stage3Coordinator::wait(size_t g) {
  auto& grp = groups_[g];
  if (grp.state != State::kInFlight) return;
  if (!grp.launched) launch_queued(g);
  clock_.time([&] { finish(g); }, "wait for a gather");
  // The device buffer the all-gather sent from goes when the compute stream,
  // which now waits for the all-gather, gets there (NOTE [device streams]).
  if (grp.send.defined() && !grp.send.is_same(params_.part(g))) stream_.record_on_current(grp.send);
  grp.send = at::Tensor();
  if (grp.staged.defined()) stream_.record_on_current(grp.staged);
  grp.staged = at::Tensor();
  // Sent: the shard's buffer is free once the copy out of it has ended.
  if (swapper_ != nullptr && !grp.from_secondary) {
    swapper_->release(g, grp.shard_copy);
    if (swapper_->on_disk(g)) grp.shard_copy = StreamEvent();
  }
  grp.state = State::kGathered;
  bind(g);
  keep_secondary(g);
}

// NOTE [hpZ]: a layer's first gather after the parameters changed leaves
// this rank's part of it in the node's copy.
void Stage3Coordinator::keep_secondary(size_t g) {
  auto& grp = groups_[g];
  if (hpz_comm_ == nullptr || g == 0 || grp.secondary.defined()) return;
  // Only for training: a gather under no_grad (evaluation, saving) has no
  // backward to serve, and would hold the copy past the step.
  if (!in_backward_ && !at::GradMode::is_enabled()) return;
  // Under qwZ an exact gather (with_gathered: saving) leaves no copy, so that
  // training computes with qwZ's values whether or not a run saves.
  if (options_.quantize_weights && !grp.quantized) return;
  const at::Tensor& full = params_.full(g);
  const int64_t n = full.numel() / hpz_comm_->world_size();
  grp.secondary_bytes = LedgerAlloc::reserve(ledger_, Tier::kDevice, kind_of(g),
                                             n * static_cast<int64_t>(full.element_size()),
                                             "hpZ secondary partition of " + params_.all_groups()[g].name);
  grp.secondary = full.narrow(0, hpz_comm_->rank() * n, n).clone();
  grp.secondary_quantized = grp.quantized;
}

void Stage3Coordinator::drop_secondary(size_t g) {
  auto& grp = groups_[g];
  ZERO_CHECK(!(grp.state == State::kInFlight && grp.from_secondary), "hpZ copy dropped while gathered from");
  grp.secondary = at::Tensor();
  grp.secondary_bytes = LedgerReservation();
}

void Stage3Coordinator::drop_secondaries() {
  for (size_t g = 0; g < groups_.size(); ++g) drop_secondary(g);
}

int64_t Stage3Coordinator::secondary_bytes() const {
  int64_t total = 0;
  for (const auto& grp : groups_)
    if (grp.secondary.defined()) total += grp.secondary.numel() * static_cast<int64_t>(grp.secondary.element_size());
  return total;
}

// The host-side part of waiting for group g's gather: the id check, then the
// collective (under NCCL this makes the current stream wait, not the host),
// then the compute stream waits for the gather stream's part.
void Stage3Coordinator::finish(size_t g) {
  auto& grp = groups_[g];
  check_pairing(g);
  if (grp.work.pending()) grp.work.wait();
  for (auto& hop : grp.hops) hop.wait();
  grp.hops.clear();
  grp.done.block_current();
  grp.done = StreamEvent();
  if (grp.received.defined()) {
    // NOTE [quantized gather]: decoded on the compute stream, which now
    // waits for the gather; the payloads go when it gets past the decoding.
    at::Tensor full = params_.full(g);
    dequantize_gathered(grp.received, full, world_size_, options_.quant_block);
    stream_.record_on_current(grp.received);
    grp.received = at::Tensor();
    grp.buffer_bytes = LedgerReservation();
  }
}

// Group g's exchange of ids (NOTE [stage-3 trace]), once: every rank must
// be gathering the same group.
void Stage3Coordinator::check_pairing(size_t g) {
  auto& grp = groups_[g];
  if (!grp.check.work.pending()) return;
  const auto ids = comm_->finish(grp.check);
  for (size_t r = 0; r < ids.size(); ++r) {
    if (ids[r] == static_cast<int64_t>(g)) continue;
    // This rank's gathers no longer pair with the others': give them all up.
    for (auto& other : groups_) {
      other.work.abandon();
      for (auto& hop : other.hops) hop.abandon();
      other.check.work.abandon();
    }
    throw Error(ErrorKind::kCommunication,
                "stage 3: ranks run different layers: rank " + std::to_string(comm_->rank()) + " gathers " +
                    describe(g) + " while rank " + std::to_string(r) + " gathers " + describe(ids[r]) +
                    "; every rank must run the same layers in the same order (a branch that depends on each "
                    "rank's data?). A module whose parts run by the data, a mixture of experts that skips an expert "
                    "without tokens say, must be one layer: make it a leaf module (InitOptions::leaf_modules, or "
                    "zero::set_leaf(module) before initialize; NOTE [leaf modules]), gathered whole whatever runs "
                    "inside it");
  }
}

std::string Stage3Coordinator::describe(int64_t g) const {
  if (g < 0 || g >= static_cast<int64_t>(groups_.size())) return "an unknown layer";
  if (g == 0) return "the always-gathered parameters";
  const auto& info = params_.all_groups()[static_cast<size_t>(g)];
  return "layer " + info.name + (info.frozen ? " (its frozen parameters)" : "");
}

// Points every parameter of group g at its place in the gathered tensor.
void Stage3Coordinator::bind(size_t g) {
  const auto& info = params_.all_groups()[g];
  const at::Tensor& full = params_.full(g);
  const auto& slots = params_.all_slots();
  for (size_t s : info.slots) {
    const auto& slot = slots[s];
    slot.param.set_data(full.narrow(0, slot.offset - info.begin, slot.numel).view(slot.shape));
  }
  groups_[g].guarded = false;
}

// Rebinds the parameters of a released group to empty tensors.
void Stage3Coordinator::guard(size_t g) {
  auto& grp = groups_[g];
  if (grp.guarded || grp.state != State::kReleased) return;
  const auto& slots = params_.all_slots();
  for (size_t s : params_.all_groups()[g].slots) slots[s].param.set_data(at::empty({0}, params_.full(g).options()));
  grp.guarded = true;
}

void Stage3Coordinator::release(size_t g) {
  auto& grp = groups_[g];
  if (grp.state == State::kReleased) return;
  if (grp.state == State::kInFlight) wait(g);  // the collective still writes into it
  set_storage_bytes(params_.full(g), 0);
  grp.bytes = LedgerReservation();
  grp.buffer_bytes = LedgerReservation();
  grp.state = State::kReleased;
  if (g != 0) live_ -= numel(g);
  // During backward, autograd still checks gradients against the parameters'
  // shapes: keep them until end_backward.
  if (!in_backward_) guard(g);
}

int64_t Stage3Coordinator::next_use_distance(size_t g) const {
  int64_t dist = 0;
  for (size_t i = cursor_; i < trace_.size(); ++i) {
    const auto& gs = units_[trace_[i].unit].groups;
    if (std::find(gs.begin(), gs.end(), g) != gs.end()) return dist;
    for (size_t h : gs) dist += numel(h);
  }
  return -1;
}

void Stage3Coordinator::maybe_release(size_t g, bool traced) {
  const auto& grp = groups_[g];
  if (g == 0 || grp.users > 0 || grp.state == State::kReleased) return;
  if (trusted_ && traced) {
    const int64_t d = next_use_distance(g);
    if (d >= 0 && d <= options_.max_reuse_distance) return;  // used again soon: keep
  }
  release(g);
}

// Frees gathered groups that no running layer needs, the furthest next use
// first, until `numel` more elements fit under max_live_parameters.
void Stage3Coordinator::make_room(int64_t n) {
  while (live_ + n > options_.max_live_numel) {
    size_t victim = 0;
    int64_t furthest = -2;
    for (size_t g = 1; g < groups_.size(); ++g) {
      if (groups_[g].state != State::kGathered || groups_[g].users > 0) continue;
      int64_t d = trusted_ ? next_use_distance(g) : -1;
      if (d < 0) d = std::numeric_limits<int64_t>::max();
      if (d > furthest) {
        furthest = d;
        victim = g;
      }
    }
    if (victim == 0) return;  // nothing to free: this layer goes over the limit
    release(victim);
  }
}

// Forward under no_grad (evaluation) is not traced: no backward follows. (Our
// backward events run with grad mode off, inside autograd's backward.)
bool Stage3Coordinator::traced(const Event& e) const { return e.backward || at::GradMode::is_enabled(); }

void Stage3Coordinator::on_event(Event e) {
  if (current_.size() < (1u << 20)) current_.push_back(e);
  if (!trusted_) return;
  if (cursor_ < trace_.size() && trace_[cursor_] == e) {
    ++cursor_;
    return;
  }
  trusted_ = false;
  log::warning_once("stage3.trace",
                    "stage 3: the layers ran in a different order than the recorded trace (at " +
                        std::string(e.backward ? "backward of " : "forward of ") + units_[e.unit].name +
                        "); prefetch is off until this micro-step's order is recorded");
}

void Stage3Coordinator::acquire(size_t unit, bool traced) {
  launch_queued(std::nullopt);  // what the last event prefetched goes out now
  for (size_t g : units_[unit].groups) {
    if (groups_[g].state == State::kReleased) {
      make_room(numel(g));
      issue(g, false);
    }
    ++groups_[g].users;
  }
  if (traced) {
    prefetch();  // the next layers' gathers go out before this one's is waited on
    read_ahead();
  }
  for (size_t g : units_[unit].groups) wait(g);
}

void Stage3Coordinator::prefetch() {
  if (!trusted_) return;
  int64_t in_flight = 0;
  for (size_t g = 1; g < groups_.size(); ++g)
    if (groups_[g].state == State::kInFlight && groups_[g].prefetched) in_flight += numel(g);
  for (size_t i = cursor_; i < trace_.size() && in_flight < options_.prefetch_bucket_numel; ++i) {
    for (size_t g : units_[trace_[i].unit].groups) {
      if (groups_[g].state != State::kReleased) continue;
      if (live_ + numel(g) > options_.max_live_numel) return;
      issue(g, true);
      in_flight += numel(g);
    }
  }
}

// Shards on disk of the layers after the prefetch window start reading, in
// trace order, while buffers are free (NOTE [parameter swapping]).
void Stage3Coordinator::read_ahead() {
  if (!trusted_ || swapper_ == nullptr || options_.prefetch_bucket_numel <= 0) return;  // prefetch off: none
  for (size_t i = cursor_; i < trace_.size(); ++i) {
    for (size_t g : units_[trace_[i].unit].groups) {
      if (groups_[g].state != State::kReleased || !swapper_->on_disk(g)) continue;
      if (groups_[g].secondary.defined()) continue;  // NOTE [hpZ]: its gather reads no shard
      if (!swapper_->start_read(g, /*may_wait=*/false)) return;
    }
  }
}

// The first launched gather in flight, else the first queued one (which is
// launched, in order): a choice made from the events only.
bool Stage3Coordinator::finish_a_gather() {
  for (size_t g = 1; g < groups_.size(); ++g) {
    if (groups_[g].state == State::kInFlight && groups_[g].launched) {
      wait(g);
      return true;
    }
  }
  if (unlaunched_.empty()) return false;
  wait(unlaunched_.front());
  return true;
}

void Stage3Coordinator::pre_forward(size_t unit) {
  // NOTE [ungathered use]: a layer run a second time means a whole forward
  // has passed: watching longer would only cost (a program that never runs
  // backward, evaluation only, would pay it for good).
  if (use_check_ != nullptr && !use_check_seen_.insert(unit).second) use_check_.reset();
  const Event e{unit, false};
  if (traced(e)) on_event(e);
  acquire(unit, traced(e));
  forward_span_[unit].open();
}

void Stage3Coordinator::post_forward(size_t unit) {
  forward_span_[unit].close("layer", [&] { return "forward " + units_[unit].name; }, static_cast<int64_t>(unit));
  const bool t = traced({unit, false});
  for (size_t g : units_[unit].groups) {
    --groups_[g].users;
    maybe_release(g, t);
  }
}

void Stage3Coordinator::pre_backward(size_t unit) {
  in_backward_ = true;
  on_event({unit, true});
  acquire(unit, true);
  backward_span_[unit].open();
}

void Stage3Coordinator::post_backward(size_t unit) {
  backward_span_[unit].close("layer", [&] { return "backward " + units_[unit].name; }, static_cast<int64_t>(unit));
  for (size_t g : units_[unit].groups) {
    --groups_[g].users;
    maybe_release(g, true);
  }
}

void Stage3Coordinator::end_backward() {
  in_backward_ = false;
  // A layer whose inputs need no gradient (the embedding) has no post-backward
  // hook: its backward ends with the whole one.
  for (size_t u = 0; u < units_.size(); ++u)
    if (backward_span_[u].is_open())
      backward_span_[u].close("layer", [&] { return "backward " + units_[u].name; }, static_cast<int64_t>(u));
  for (size_t g = 1; g < groups_.size(); ++g) {
    groups_[g].users = 0;
    release(g);
    guard(g);
  }
  if (!trusted_ && !current_.empty()) {
    trace_ = std::move(current_);
    trusted_ = true;
  }
  current_.clear();
  cursor_ = 0;
  use_check_.reset();  // the first micro-step has run: a missing zero::forward would have shown
}

void Stage3Coordinator::after_step() {
  drop_secondaries();  // the shards changed
  release(0);
  issue(0, false);
  wait(0);
}

void Stage3Coordinator::wait_shard_copies(size_t g) {
  auto& grp = groups_[g];
  if (grp.state == State::kInFlight) wait(g);  // its copy may not even have started
  grp.shard_copy.synchronize();
  grp.shard_copy = StreamEvent();
}

void Stage3Coordinator::shards_changed(size_t g) {
  auto& grp = groups_[g];
  ZERO_CHECK(grp.users == 0, "a shard written while its layer runs");
  wait_shard_copies(g);
  release(g);
  drop_secondary(g);
  if (g == 0) {  // always gathered
    issue(0, false);
    wait(0);
  }
}

bool Stage3Coordinator::hold(size_t g) {
  // The values as the shards hold them, not qwZ's approximation (gathered
  // now, or through hpZ's copy of it).
  const auto& had = groups_[g];
  if (had.state != State::kReleased && (had.quantized || (had.from_secondary && had.secondary_quantized))) {
    ZERO_CHECK(had.users == 0, "a layer in use is gathered exactly");
    release(g);
  }
  const bool was_released = groups_[g].state == State::kReleased;
  if (was_released) issue(g, false, /*exact=*/true);
  wait(g);
  ++groups_[g].users;
  return was_released;
}

void Stage3Coordinator::unhold(size_t g, bool was_released) {
  ZERO_CHECK(groups_[g].users > 0, "unhold without hold");
  --groups_[g].users;
  if (was_released && groups_[g].users == 0) release(g);
}

void Stage3Coordinator::with_gathered(size_t g, const std::function<void()>& fn) {
  const bool was_released = hold(g);
  try {
    fn();
  } catch (...) {
    unhold(g, was_released);
    throw;
  }
  unhold(g, was_released);
}

}  // namespace zero::partition
