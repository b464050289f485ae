#include "zero/zero/flat_parameters.h"

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "zero/runtime/error.h"

namespace zero::partition {

FlatParameters::FlatParameters(
    const std::vector<std::pair<std::string, at::Tensor>>& named_params, at::ScalarType dtype,
    at::Device device, int64_t world_size, MemoryLedger& ledger)
    : world_size_(world_size) {
  ZERO_CHECK(world_size >= 1, "world size must be positive");
  std::unordered_set<const void*> seen;
  int64_t offset = 0;
  for (const auto& [name, p] : named_params) {
    if (!p.requires_grad()) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: first use only
    ParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.offset = offset;
    slot.numel = p.numel();
    slot.shape = p.sizes().vec();
    offset += slot.numel;
    slots_.push_back(std::move(slot));
  }
  numel_ = offset;
  const int64_t unit = world_size * kPartitionAlignNumel;
  const int64_t padded = std::max<int64_t>(unit, (numel_ + unit - 1) / unit * unit);
  partition_numel_ = padded / world_size;

  flat_ = ledger.empty(padded, dtype, device, Tier::kDevice, Kind::kParameters,
                       "flat parameter buffer (" + std::to_string(numel_) + " parameters)");
  flat_.narrow(0, numel_, padded - numel_).zero_();
  at::NoGradGuard no_grad;
  for (auto& slot : slots_) {
    at::Tensor view = flat_.narrow(0, slot.offset, slot.numel).view(slot.shape);
    view.copy_(slot.param.detach());
    // Same rebinding as `p.data = view` in Python: the parameter object (and
    // every module that holds it) now reads the flat buffer.
    slot.param.set_data(view);
  }
}

at::Tensor FlatParameters::partition_of(const at::Tensor& like_flat, int64_t rank) const {
  ZERO_CHECK(like_flat.numel() == padded_numel(), "buffer is not laid out like the flat parameters");
  ZERO_CHECK(rank >= 0 && rank < world_size_, "rank out of range");
  return like_flat.narrow(0, rank * partition_numel_, partition_numel_);
}

}  // namespace zero::partition
