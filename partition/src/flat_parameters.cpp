#include "zero/core/ledger_alloc.h"
#include "zero/partition/flat_parameters.h"

#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/core/error.h"

namespace zero::partition {

FlatParameters::FlatParameters(
    const std::vector<std::pair<std::string, at::Tensor>>& named_params, at::ScalarType dtype,
    at::Device device, int64_t world_size, int64_t group_numel, MemoryLedger& ledger)
    : world_size_(world_size) {
  ZERO_CHECK(world_size >= 1, "world size must be positive");
  group_numel = std::max<int64_t>(1, group_numel);
  std::unordered_set<const void*> seen;
  for (const auto& [name, p] : named_params) {
    if (!p.requires_grad()) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: first use only
    ParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.numel = p.numel();
    slot.shape = p.sizes().vec();
    slots_.push_back(std::move(slot));
  }
  // Pack consecutive parameters into groups, pad each to the partition unit.
  const int64_t unit = world_size * kPartitionAlignNumel;
  int64_t offset = 0;
  for (size_t i = 0; i < slots_.size();) {
    FlatGroup g;
    g.begin = offset;
    int64_t used = 0;
    while (i < slots_.size() && (used == 0 || used + slots_[i].numel <= group_numel)) {
      slots_[i].offset = offset + used;
      slots_[i].group = groups_.size();
      used += slots_[i].numel;
      g.slots.push_back(i++);
    }
    numel_ += used;
    g.padded_numel = std::max<int64_t>(unit, (used + unit - 1) / unit * unit);
    g.chunk_numel = g.padded_numel / world_size;
    g.owned_offset = owned_numel_;
    owned_numel_ += g.chunk_numel;
    offset += g.padded_numel;
    groups_.push_back(std::move(g));
  }
  if (groups_.empty()) {  // a model without trainable parameters still gets a valid buffer
    FlatGroup g;
    g.padded_numel = unit;
    g.chunk_numel = kPartitionAlignNumel;
    owned_numel_ = g.chunk_numel;
    offset = unit;
    groups_.push_back(g);
  }
  trainable_slots_ = slots_.size();
  trainable_groups_ = groups_.size();

  flat_ = LedgerAlloc::empty(ledger, offset, dtype, device, Tier::kDevice, Kind::kParameters,
                       "flat parameter buffer (" + std::to_string(numel_) + " parameters)");
  flat_.zero_();
  at::NoGradGuard no_grad;
  for (auto& slot : slots_) {
    at::Tensor view = flat_.narrow(0, slot.offset, slot.numel).view(slot.shape);
    view.copy_(slot.param.detach());
    // Same rebinding as `p.data = view` in Python: the parameter object (and
    // every module that holds it) now reads the flat buffer.
    slot.param.set_data(view);
  }
}

void copy_chunk_of(const std::vector<at::Tensor>& params, int64_t begin, at::Tensor& chunk) {
  at::NoGradGuard no_grad;
  const int64_t end = begin + chunk.numel();
  chunk.zero_();
  int64_t offset = 0;
  for (const auto& p : params) {
    const int64_t lo = std::max(offset, begin), hi = std::min(offset + p.numel(), end);
    if (lo < hi) chunk.narrow(0, lo - begin, hi - lo).copy_(p.reshape({-1}).narrow(0, lo - offset, hi - lo));
    offset += p.numel();
  }
}

int64_t FlatParameters::padded_size(int64_t numel, int64_t world_size) {
  const int64_t unit = world_size * kPartitionAlignNumel;
  return std::max<int64_t>(unit, (numel + unit - 1) / unit * unit);
}

void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  if (nbytes == 0) {
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  } else {
    ZERO_CHECK(s->allocator() != nullptr, "storage has no allocator");
    // The CUDA caching allocator allocates on the current device: make it the storage's.
    const c10::DeviceGuard guard(s->device());
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  }
  s->set_nbytes(nbytes);
}

FlatParameters::FlatParameters(std::vector<GroupSpec> specs, at::ScalarType dtype, at::Device device,
                               int64_t world_size, int64_t rank, Tier partition_tier, MemoryLedger& ledger)
    : world_size_(world_size) {
  ZERO_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rank out of range");
  std::unordered_set<const void*> seen;
  int64_t offset = 0;
  for (size_t gi = 0; gi < specs.size(); ++gi) {
    auto& spec = specs[gi];
    // NOTE [frozen groups]: after every trainable group, so that groups()
    // is a prefix of all_groups().
    ZERO_CHECK(spec.frozen || gi == 0 || !specs[gi - 1].frozen, "a trainable group after a frozen one (" + spec.name + ")");
    FlatGroup g;
    g.name = spec.name;
    g.begin = offset;
    g.frozen = spec.frozen;
    int64_t used = 0;
    for (size_t k = 0; k < spec.params.size(); ++k) {
      const auto& [name, p] = spec.params[k];
      if (spec.chunk.defined() || spec.chunk_on_disk) {
        // Made by zero::Init: every parameter is in the chunk, so none may
        // have changed sides since (the plan refuses that, naming it).
        ZERO_CHECK(p.requires_grad() != spec.frozen, "parameter " + name + " of a pre-partitioned group changed "
                   "requires_grad");
      } else if (p.requires_grad() == spec.frozen) {
        continue;
      }
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: first group only
      ParamSlot slot;
      slot.name = name;
      slot.param = p;
      slot.shape = spec.chunk.defined() || spec.chunk_on_disk ? spec.shapes.at(k) : p.sizes().vec();
      slot.numel = c10::multiply_integers(slot.shape);
      slot.offset = offset + used;
      slot.group = groups_.size();
      used += slot.numel;
      g.slots.push_back(slots_.size());
      slots_.push_back(std::move(slot));
    }
    g.padded_numel = padded_size(used, world_size);
    g.chunk_numel = g.padded_numel / world_size;
    if (spec.frozen) {
      g.owned_offset = -1;
    } else {
      numel_ += used;
      g.owned_offset = owned_numel_;
      owned_numel_ += g.chunk_numel;
      trainable_slots_ = slots_.size();
      trainable_groups_ = groups_.size() + 1;
    }
    offset += g.padded_numel;
    groups_.push_back(std::move(g));
  }
  // Allocate every shard first (this may throw: nothing is changed yet).
  const at::Device part_device = partition_tier == Tier::kDevice ? device : at::Device(at::kCPU);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const auto& g = groups_[gi];
    const at::Tensor& made = specs[gi].chunk;
    if (specs[gi].chunk_on_disk) {  // the parameter swapper reads it when needed
      parts_.push_back(at::empty({0}, at::TensorOptions().dtype(dtype).device(part_device)));
      continue;
    }
    if (made.defined()) {
      ZERO_CHECK(made.numel() == g.chunk_numel,
                 "pre-partitioned chunk of " + g.name + " has " + std::to_string(made.numel()) +
                     " elements; the layout expects " + std::to_string(g.chunk_numel));
      if (made.scalar_type() == dtype && made.device() == part_device && made.is_contiguous()) {
        parts_.push_back(made);  // zero::Init's shard, already in the ledger: adopted
        continue;
      }
    }
    parts_.push_back(LedgerAlloc::empty(ledger, g.chunk_numel, dtype, part_device, partition_tier,
                                        g.frozen ? Kind::kFrozenParameters : Kind::kParameters,
                                        std::string(g.frozen ? "stage-3 frozen shard of " : "stage-3 shard of ") +
                                            (g.name.empty() ? std::string("group 0") : g.name)));
  }
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const auto& g = groups_[gi];
    at::Tensor& chunk = parts_[gi];
    if (specs[gi].chunk_on_disk) {
      // nothing to copy
    } else if (specs[gi].chunk.defined()) {
      if (!chunk.is_same(specs[gi].chunk)) chunk.copy_(specs[gi].chunk);
    } else {
      // Every rank holds the whole group here: keep this rank's chunk of it.
      std::vector<at::Tensor> values;
      for (size_t s : g.slots) values.push_back(slots_[s].param.detach());
      copy_chunk_of(values, rank * g.chunk_numel, chunk);
    }
    // The group's full-size tensor: its shape now, its memory when gathered.
    at::Tensor full = at::empty({0}, opts);
    full.unsafeGetTensorImpl()->set_sizes_contiguous({g.padded_numel});
    full_.push_back(std::move(full));
    for (size_t s : g.slots) slots_[s].param.set_data(at::empty({0}, opts));
  }
}

at::Tensor FlatParameters::group_of(const at::Tensor& like_flat, size_t g) const {
  ZERO_CHECK(like_flat.numel() == padded_numel(), "buffer is not laid out like the flat parameters");
  return like_flat.narrow(0, groups_[g].begin, groups_[g].padded_numel);
}

at::Tensor FlatParameters::chunk_of(const at::Tensor& like_flat, size_t g, int64_t rank) const {
  ZERO_CHECK(rank >= 0 && rank < world_size_, "rank out of range");
  return group_of(like_flat, g).narrow(0, rank * groups_[g].chunk_numel, groups_[g].chunk_numel);
}

at::Tensor FlatParameters::owned_chunk_of(const at::Tensor& like_owned, size_t g) const {
  ZERO_CHECK(like_owned.numel() == owned_numel_, "buffer is not laid out like the owned partition");
  ZERO_CHECK(!groups_[g].frozen, "a frozen group has no owned chunk");
  return like_owned.narrow(0, groups_[g].owned_offset, groups_[g].chunk_numel);
}

}  // namespace zero::partition
