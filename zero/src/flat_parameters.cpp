#include "zero/zero/flat_parameters.h"

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/runtime/error.h"

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

  flat_ = ledger.empty(offset, dtype, device, Tier::kDevice, Kind::kParameters,
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
  return like_owned.narrow(0, groups_[g].owned_offset, groups_[g].chunk_numel);
}

}  // namespace zero::partition
