// Host buffers that transfers use in turn (NOTE [offload transfers]).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/core/ledger_alloc.h"
#include "zero/core/streams.h"

namespace zero::partition {

/// `count` buffers of `numel` elements, pinned when asked (the ledger falls
/// back to pageable memory past its pinned limit), counted as communication
/// buffers. Each remembers the transfer that used it last; next() returns
/// the following buffer once that transfer has ended. Not thread-safe.
class HostRing {
 public:
  HostRing() = default;
  HostRing(MemoryLedger& ledger, bool pin, int count, int64_t numel, at::ScalarType dtype,
           const std::string& what) {
    for (int i = 0; i < count; ++i) buffers_.push_back(LedgerAlloc::host_empty(ledger, numel, dtype, pin, Kind::kCommBuffers, what));
    last_use_.resize(buffers_.size());
  }
  bool defined() const { return !buffers_.empty(); }
  int64_t numel() const { return buffers_.empty() ? 0 : buffers_[0].numel(); }

  /// The next buffer's first `numel` elements. The host first waits for the
  /// transfer that used it last (the time is added to `wait_s`).
  at::Tensor next(int64_t numel, double& wait_s) {
    cursor_ = (cursor_ + 1) % buffers_.size();
    StreamEvent& last = last_use_[cursor_];
    const auto t0 = std::chrono::steady_clock::now();
    last.synchronize();
    wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last = StreamEvent();
    return buffers_[cursor_].narrow(0, 0, numel);
  }
  /// The transfer that uses the buffer next() returned last.
  void used_by(StreamEvent e) { last_use_[cursor_] = std::move(e); }

 private:
  std::vector<at::Tensor> buffers_;
  std::vector<StreamEvent> last_use_;
  size_t cursor_ = 0;
};

}  // namespace zero::partition
