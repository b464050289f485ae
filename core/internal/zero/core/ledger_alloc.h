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

/// Whether `t`'s memory is page-locked host memory, as the CUDA driver
/// reports it (cudaPointerGetAttributes). Not at::Tensor::is_pinned(): since
/// LibTorch 2.8 that asks LibTorch's own caching host allocator, which
/// answers false for memory it did not hand out (the pinned tier's
/// cudaHostAlloc buffers) until it has made a block of its own. False
/// without CUDA.
bool page_locked(const at::Tensor& t);

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
/// Sets the CPU peak (and the emulated device peak) to the current value.
void reset_cpu_allocator_peak();

/// A CPU run's "device" memory: CPU tensor bytes that no ledger counts on its
/// pinned or pageable host tier (parameters, gradients and states kept "on the
/// device", activations, temporaries). NOTE [emulated device memory].
struct CpuDeviceStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t limit_bytes = 0;  // 0: no cap
};
CpuDeviceStats cpu_device_stats();

/// Caps a CPU run's device memory at `nbytes` (<= 0 removes the cap): an
/// allocation past it throws zero::OutOfMemoryError naming the bytes asked,
/// the bytes in use, the cap and `help` (the option that set it and the
/// config keys that would make the run fit). Needs the counting allocator
/// (installs it). Process-wide, as the allocator.
void limit_cpu_device_memory(int64_t nbytes, const std::string& help);

}  // namespace zero
