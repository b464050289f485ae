// NOTE [state store] in state_store.h.
#include "zero/partition/state_store.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "zero/core/error.h"
#include "zero/partition/stage3_rules.h"

namespace zero::partition {

StateStore::StateStore(const FlatParameters& params, const optim::FlatOptimizer& optimizer, StoreOptions options,
                       MemoryLedger& ledger, ParamMaster param_master)
    : params_(params), options_(std::move(options)), ledger_(ledger), param_master_(std::move(param_master)) {
  if (options_.nvme) options_.offload = true;
  ZERO_CHECK(!(param_master_ && options_.offload), "an offloaded master cannot be the parameters");
  ZERO_CHECK(!(param_master_ && options_.master_dtype != at::kFloat), "a 16-bit master is its own buffer");
  ZERO_CHECK(options_.ratio >= 0.0 && options_.ratio <= 1.0, "offload_optimizer.ratio is between 0 and 1");
  ZERO_CHECK(options_.ratio == 1.0 || options_.offload, "a partial offload (ratio < 1) is of offload_optimizer");
  const int64_t size = std::max<int64_t>(1, options_.sub_group_size);
  std::vector<int64_t> numels;
  for (size_t g = 0; g < params_.groups().size(); ++g) {
    const int64_t n = params_.groups()[g].chunk_numel;
    numels.push_back(n);
    for (int64_t start = 0; start < n; start += size) sub_groups_.push_back({g, start, std::min(size, n - start)});
  }
  // NOTE [state placement]: each group's tier, and its place in that tier's
  // buffers (the device's, or off the device: the groups in host memory
  // first, then NVMe's, whose gradients are in host memory too).
  host_ = options_.offload ? state_tiers(numels, options_.ratio, options_.nvme.has_value(), options_.max_in_cpu)
                           : std::vector<char>(numels.size(), kStatesOnDevice);
  int64_t tier_numel[2] = {0, 0}, memory_numel = 0;  // (off the device: those in host memory)
  for (size_t g = 0; g < numels.size(); ++g) {
    at_.push_back(tier_numel[host_[g] ? 1 : 0]);
    tier_numel[host_[g] ? 1 : 0] += numels[g];
    if (host_[g] == kStatesInHostMemory) memory_numel += numels[g];
  }
  first_disk_ = sub_groups_.size();
  for (size_t k = sub_groups_.size(); k-- > 0 && host_[sub_groups_[k].group] == kStatesOnNvme;) first_disk_ = k;
  names_.push_back("fp32_master");
  specs_ = optimizer.state_specs();
  // min_8bit_size: the blocks of each sub-group that hold an element of a
  // smaller parameter keep fp32 moments (NOTE [8-bit states]).
  fp32_blocks_.resize(sub_groups_.size());
  const auto side = std::find_if(specs_.begin(), specs_.end(), [](const auto& spec) { return spec.side; });
  const int64_t min_8bit = optimizer.config().min_8bit_size;
  for (size_t k = 0; side != specs_.end() && min_8bit > 0 && k < sub_groups_.size(); ++k) {
    const auto& sg = sub_groups_[k];
    const auto& grp = params_.groups()[sg.group];
    const int64_t lo = grp.begin + options_.layout_rank * grp.chunk_numel + sg.start, hi = lo + sg.numel;
    const int64_t block = side->per_block;  // the 8-bit blocks'
    std::vector<int64_t> blocks;
    for (size_t slot : grp.slots) {
      const auto& ps = params_.slots()[slot];
      const int64_t b = std::max(lo, ps.offset), e = std::min(hi, ps.offset + ps.numel);
      if (ps.numel >= min_8bit || e <= b) continue;
      for (int64_t q = (b - lo) / block; q <= (e - 1 - lo) / block; ++q) blocks.push_back(q);
    }
    std::sort(blocks.begin(), blocks.end());
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    fp32_blocks_[k] = std::move(blocks);
  }
  for (const auto& spec : specs_) {
    names_.push_back(spec.name);
    initial_.push_back(spec.initial);
    // A block-wise state (8-bit Adam's scales, the fp32 blocks' moments) is
    // laid out sub-group after sub-group, each from its own first element
    // (NOTE [8-bit states]).
    // (Each tier's sub-groups after each other.)
    std::vector<int64_t> at, len;
    int64_t total[2] = {0, 0};
    for (size_t k = 0; k < sub_groups_.size(); ++k) {
      int64_t& t = total[host_[sub_groups_[k].group] ? 1 : 0];
      at.push_back(t);
      len.push_back(spec.side ? spec.side_numel(static_cast<int64_t>(fp32_blocks_[k].size()))
                              : spec.numel_for(sub_groups_[k].numel));
      t += len.back();
    }
    state_at_.push_back(std::move(at));
    state_len_.push_back(std::move(len));
  }
  tier_ = first_disk_ < sub_groups_.size() ? Tier::kNvme
          : !options_.offload               ? Tier::kDevice
          : options_.pin_memory             ? Tier::kPinnedHost
                                            : Tier::kHost;
  // A buffer of a tier's share of the owned partition (none when it is
  // empty): on the device, or offloaded in host memory, pinned when asked
  // and within the ledger's pinned limit.
  auto buffer = [&](int t, at::ScalarType dtype, Kind kind, const std::string& what, int64_t numel) {
    if (numel == 0) return at::Tensor();
    if (t == 0) return LedgerAlloc::empty(ledger_, numel, dtype, options_.device, Tier::kDevice, kind, what);
    return LedgerAlloc::host_empty(ledger_, numel, dtype, options_.pin_memory, kind, what);
  };
  grad_partition_ = options_.grad_partition;
  if (options_.grad_partition) {
    // Offloaded below stage 3, the partition accumulates on the host in fp32
    // with an fp32 master, as DeepSpeed's; with a 16-bit master ("master
    // weights and grads") in the accumulation dtype, the master's unless
    // data_types.grad_accum_dtype says otherwise. Stage 3's is in the
    // accumulation dtype on every tier (NOTE [16-bit gradients]).
    const at::ScalarType host = options_.host_grad_dtype ? *options_.host_grad_dtype
                                : options_.master_dtype == at::kFloat ? at::kFloat
                                                                      : options_.grad_dtype;
    // (With gradients_on_device, every group's on the device, in the dtype
    // the host's would have: NOTE [device gradients].)
    const int64_t grad_numel[2] = {options_.grads_on_device ? tier_numel[0] + tier_numel[1] : tier_numel[0],
                                   options_.grads_on_device ? 0 : tier_numel[1]};
    const at::ScalarType device = options_.grads_on_device ? host : options_.grad_dtype;
    for (int t = 0; t < 2; ++t) {
      tiers_[t].grads = buffer(t, t == 1 ? host : device, Kind::kGradients, "owned gradient partition",
                               grad_numel[t]);
      if (tiers_[t].grads.defined()) tiers_[t].grads.zero_();
    }
  }
  if (first_disk_ < sub_groups_.size()) {  // the swapper's sub-groups are the last ones
    std::vector<SwapTensor> tensors{{names_[0], options_.master_dtype, 0}};
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto& spec = specs_[i];
      tensors.push_back({spec.name, spec.dtype, spec.per_block});
      if (spec.side)  // each sub-group's own length
        tensors.back().numels.assign(state_len_[i].begin() + static_cast<ptrdiff_t>(first_disk_), state_len_[i].end());
    }
    std::vector<int64_t> disk;
    for (size_t k = first_disk_; k < sub_groups_.size(); ++k) disk.push_back(sub_groups_[k].numel);
    swapper_ = std::make_unique<StateSwapper>(std::move(disk), std::move(tensors), *options_.nvme, ledger_);
  }
  tier_numel[1] = memory_numel;  // the master and states off the device: those in host memory
  for (int t = 0; t < 2; ++t) {
    if (!param_master_)
      tiers_[t].master = buffer(t, options_.master_dtype, Kind::kOptimizerStates,
                                std::string(options_.master_dtype == at::kBFloat16 ? "bf16"
                                            : options_.master_dtype == at::kHalf   ? "fp16"
                                                                                   : "fp32") +
                                    " master parameters",
                                tier_numel[t]);
    for (size_t i = 0; i < specs_.size(); ++i) {
      int64_t numel = 0;  // this tier's sub-groups' parts
      for (size_t k = 0; k < first_disk_; ++k)
        if ((host_[sub_groups_[k].group] ? 1 : 0) == t) numel += state_len_[i][k];
      tiers_[t].states.push_back(buffer(t, specs_[i].dtype, Kind::kOptimizerStates, "optimizer state " + names_[i + 1], numel));
    }
  }
}

at::Tensor StateStore::chunk_of(const at::Tensor& buf, size_t g) const {
  return buf.narrow(0, at_.at(g), params_.groups()[g].chunk_numel);
}

void StateStore::init(const std::function<at::Tensor(size_t g)>& chunk, const std::function<void(size_t g)>& done) {
  for (size_t k = 0; k < first_disk_; ++k) {
    std::vector<at::Tensor> st = sub_group_states(k);
    start_states(k, st);
  }
  if (!param_master_) {
    for (size_t g = 0; g < params_.groups().size(); ++g) {
      if (on_nvme(g)) continue;
      master(g).copy_(chunk(g));
      done(g);
    }
  }
  if (!swapper_) return;
  swapper_->pass(/*read=*/false, /*write=*/true, [&](size_t j, const std::vector<at::Tensor>& t) {
    const size_t k = first_disk_ + j;
    const auto [g, start, len] = sub_groups_[k];
    t[0].copy_(chunk(g).narrow(0, start, len));
    std::vector<at::Tensor> st(t.begin() + 1, t.end());
    start_states(k, st);
    if (k + 1 == sub_groups_.size() || sub_groups_[k + 1].group != g) done(g);
  });
  swapper_->clear_timings();
}

void StateStore::visit(bool write_back, const Visit& fn) {
  for (size_t k = 0; k < first_disk_; ++k) {
    const auto [g, start, len] = sub_groups_[k];
    fn(k, master(g).narrow(0, start, len), sub_group_states(k));
  }
  if (!swapper_) return;
  swapper_->pass(/*read=*/true, write_back, [&](size_t j, const std::vector<at::Tensor>& t) {
    fn(first_disk_ + j, t[0], std::vector<at::Tensor>(t.begin() + 1, t.end()));
  });
}

void StateStore::start_states(size_t k, std::vector<at::Tensor>& st) const {
  ZERO_CHECK(st.size() == initial_.size(), "a tensor per optimizer state");
  for (size_t i = 0; i < st.size(); ++i) st[i].fill_(initial_[i]);
  optim::mark_fp32_blocks(fp32_blocks_.at(k), st);
}

std::vector<at::Tensor> StateStore::sub_group_states(size_t k) const {
  const auto [g, start, len] = sub_groups_[k];
  std::vector<at::Tensor> s;
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].per_block > 0) s.push_back(buffers_of(g).states[i].narrow(0, state_at_[i][k], state_len_[i][k]));
    else s.push_back(state(i, g).narrow(0, start, len));
  }
  return s;
}

std::vector<at::Tensor> StateStore::views(size_t k) const {
  const auto [g, start, len] = sub_groups_.at(k);
  std::vector<at::Tensor> v{master(g).narrow(0, start, len)};
  for (auto& st : sub_group_states(k)) v.push_back(std::move(st));
  return v;
}

void StateStore::prefetch() {
  if (swapper_) swapper_->prefetch();
}

at::Tensor StateStore::master(size_t g) const {
  ZERO_CHECK(!on_nvme(g), "the master is on NVMe: visit() it");
  if (param_master_) return param_master_(g);
  return chunk_of(buffers_of(g).master, g);
}

at::Tensor StateStore::state(size_t i, size_t g) const {
  ZERO_CHECK(!on_nvme(g) && i < specs_.size(), "no such optimizer state in memory");
  const at::Tensor& buf = buffers_of(g).states[i];
  if (specs_[i].per_block == 0) return chunk_of(buf, g);
  // A block-wise state: the blocks of g's sub-groups, which are consecutive.
  int64_t begin = -1, end = 0;
  for (size_t k = 0; k < sub_groups_.size(); ++k) {
    if (sub_groups_[k].group != g) continue;
    if (begin < 0) begin = state_at_[i][k];
    end = state_at_[i][k] + state_len_[i][k];
  }
  if (begin < 0) return buf.defined() ? buf.narrow(0, 0, 0) : at::Tensor();  // an empty group
  return buf.narrow(0, begin, end - begin);
}

int64_t StateStore::state_numel(size_t i, size_t k) const { return state_len_.at(i).at(k); }

at::Tensor StateStore::grad(size_t g) const {
  ZERO_CHECK(grad_partition_, "no gradient partition below stage 2");
  if (options_.grads_on_device) return params_.owned_chunk_of(tiers_[0].grads, g);  // the owned layout
  return chunk_of(buffers_of(g).grads, g);
}

void StateStore::zero_grads() {
  for (auto& t : tiers_)
    if (t.grads.defined()) t.grads.zero_();
}

}  // namespace zero::partition
