// Flat parameter buffers: the trainable parameters of a model laid out in one
// contiguous buffer, each parameter rebound to a view into it.
//
// NOTE [flat layout]
// Parameters are packed in module order (a parameter shared by two modules,
// a tied weight, appears once, at its first use), back to back, and the
// buffer is padded with zeros to a multiple of world_size * kPartitionAlignNumel
// elements, so it splits into world_size equal partitions whose boundaries are
// aligned for SIMD and for O_DIRECT I/O of fp32 slices. Rank r owns
// [r * partition_numel, (r + 1) * partition_numel). Padding is never read as a
// parameter; its gradient is zero and it stays zero under every optimizer.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/runtime/memory_ledger.h"

namespace zero::partition {

inline constexpr int64_t kPartitionAlignNumel = 256;

/// One trainable parameter's place in the flat buffer.
struct ParamSlot {
  std::string name;    // first name it was found under ("h.0.attn.query.weight")
  at::Tensor param;    // the module's parameter (now a view into the flat buffer)
  int64_t offset = 0;  // in elements, into the flat buffer
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

class FlatParameters {
 public:
  /// Copies the values of `named_params` (deduplicated by identity) into one
  /// flat buffer of `dtype` on `device`, allocated through `ledger` as
  /// (device tier, parameters), and rebinds every parameter to its view.
  /// Parameters keep requires_grad. Throws zero::OutOfMemoryError from the ledger.
  FlatParameters(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                 at::ScalarType dtype, at::Device device, int64_t world_size,
                 MemoryLedger& ledger);
  FlatParameters(const FlatParameters&) = delete;
  FlatParameters& operator=(const FlatParameters&) = delete;

  const at::Tensor& flat() const { return flat_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  /// Elements that are parameters (no padding): the model's parameter count.
  int64_t numel() const { return numel_; }
  /// Elements including padding: world_size * partition_numel().
  int64_t padded_numel() const { return flat_.numel(); }
  int64_t partition_numel() const { return partition_numel_; }
  int64_t world_size() const { return world_size_; }
  /// This rank's slice of a buffer laid out like flat() (any dtype).
  at::Tensor partition_of(const at::Tensor& like_flat, int64_t rank) const;

 private:
  std::vector<ParamSlot> slots_;
  at::Tensor flat_;
  int64_t numel_ = 0;
  int64_t partition_numel_ = 0;
  int64_t world_size_ = 1;
};

}  // namespace zero::partition
