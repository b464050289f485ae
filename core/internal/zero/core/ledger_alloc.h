// Allocation through the memory ledger (internal: the engine's buffers).
//
// NOTE [memory ledger]
// Every buffer the engine allocates comes from LedgerAlloc::empty(), which
// returns an ordinary tensor whose storage, when freed, takes its bytes off
// the ledger, so the ledger is right however long the tensor lives. The
// ledger's state is shared with those tensors and outlives the MemoryLedger
// object if needed. Bytes that live outside tensors (NVMe swap files) are
// counted by a LedgerReservation. Peaks are per (tier, kind) and per tier
// total. Alongside, on the CPU, a counting allocator
// (install_counting_cpu_allocator) sees every CPU tensor allocation,
// activations included: that is the real peak of the "device" tier when the
// device is the CPU. All functions are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "zero/core/memory_ledger.h"

namespace zero {

/// Bytes counted on a ledger until the handle is destroyed. Move-only.
class LedgerReservation {
 public:
  LedgerReservation() = default;
  LedgerReservation(LedgerReservation&&) noexcept;
  LedgerReservation& operator=(LedgerReservation&&) noexcept;
  ~LedgerReservation();
  int64_t nbytes() const { return nbytes_; }

 private:
  friend class LedgerAlloc;
  std::shared_ptr<MemoryLedger::Shared> state_;
  Tier tier_ = Tier::kDevice;
  Kind kind_ = Kind::kParameters;
  int64_t nbytes_ = 0;
};

class LedgerAlloc {
 public:
  /// An uninitialised tensor of `numel` elements on `device`, counted under
  /// (tier, kind) until its storage is freed. The pinned-host tier is
  /// page-locked when CUDA is present. `what` names the buffer in
  /// out-of-memory messages. Throws zero::OutOfMemoryError when the tier has
  /// a limit the allocation would pass.
  static at::Tensor empty(MemoryLedger& ledger, int64_t numel, at::ScalarType dtype, at::Device device, Tier tier,
                          Kind kind, const std::string& what);
  /// Host memory for offloaded state: on the pinned tier when `pin` asks and
  /// its limit allows, else pageable (the host tier), with a one-time warning
  /// the first time the pinned limit sends something there. Throws
  /// zero::OutOfMemoryError when the host tier is full too.
  static at::Tensor host_empty(MemoryLedger& ledger, int64_t numel, at::ScalarType dtype, bool pin, Kind kind,
                               const std::string& what);
  /// Counts `nbytes` that live outside tensors (NVMe swap files, say) until
  /// the handle is destroyed. Same limit check as empty().
  static LedgerReservation reserve(MemoryLedger& ledger, Tier tier, Kind kind, int64_t nbytes,
                                   const std::string& what);
};

/// Process-wide CPU tensor statistics from the counting allocator.
struct CpuAllocatorStats {
  bool installed = false;
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;
};

/// Wraps LibTorch's CPU allocator with one that counts bytes: a process-wide
/// side effect (the engine installs it when training on the CPU), idempotent.
/// Tensors allocated before the call are not counted, and are freed normally.
void install_counting_cpu_allocator();
CpuAllocatorStats cpu_allocator_stats();
/// Sets the CPU peak to the current value.
void reset_cpu_allocator_peak();

}  // namespace zero
