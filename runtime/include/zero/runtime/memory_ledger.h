// The memory ledger: every buffer the engine allocates, by tier and kind,
// with current and peak bytes, and optional per-tier limits.
//
// NOTE [memory ledger]
// Buffers are allocated through MemoryLedger::empty(), which returns an
// ordinary tensor whose storage, when freed, takes its bytes off the ledger,
// so the ledger is right however long the tensor lives. The ledger's state is
// shared with those tensors and outlives the MemoryLedger object if needed.
// Peaks are per (tier, kind) and per tier total. Alongside, on the CPU, a
// counting allocator (install_counting_cpu_allocator) sees every CPU tensor
// allocation, activations included: that is the real peak of the "device"
// tier when the device is the CPU. All methods are thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "zero/runtime/text.h"  // format_bytes

namespace zero {

enum class Tier { kDevice = 0, kPinnedHost, kHost, kNvme };
enum class Kind { kParameters = 0, kGradients, kOptimizerStates, kActivations, kCommBuffers };
inline constexpr int kNumTiers = 4;
inline constexpr int kNumKinds = 5;

const char* to_string(Tier tier);  // "device", "pinned_host", "host", "nvme"
const char* to_string(Kind kind);  // "parameters", "gradients", ...

struct LedgerCounter {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};

class MemoryLedger {
  struct Shared;  // the counters, shared with the deleters of live buffers

 public:
  MemoryLedger();
  ~MemoryLedger();
  MemoryLedger(const MemoryLedger&) = delete;
  MemoryLedger& operator=(const MemoryLedger&) = delete;

  /// Allocates an uninitialised tensor of `numel` elements on `device`, counted
  /// under (tier, kind) until its storage is freed. The pinned-host tier is
  /// page-locked when CUDA is present. `what` names the buffer
  /// in out-of-memory messages. Throws zero::OutOfMemoryError when the tier
  /// has a limit that the allocation would pass.
  at::Tensor empty(int64_t numel, at::ScalarType dtype, at::Device device, Tier tier, Kind kind,
                   const std::string& what);

  /// Counts bytes that live outside tensors (NVMe swap files, say) until the
  /// returned handle is destroyed. Same limit check as empty().
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&&) noexcept;
    Reservation& operator=(Reservation&&) noexcept;
    ~Reservation();
    int64_t nbytes() const { return nbytes_; }

   private:
    friend class MemoryLedger;
    std::shared_ptr<MemoryLedger::Shared> state_;
    Tier tier_ = Tier::kDevice;
    Kind kind_ = Kind::kParameters;
    int64_t nbytes_ = 0;
  };
  Reservation reserve(Tier tier, Kind kind, int64_t nbytes, const std::string& what);

  /// Host memory for offloaded state: on the pinned tier when `pin` asks and
  /// its limit allows, else pageable (the host tier), with a one-time warning
  /// the first time the pinned limit sends something there. Throws
  /// zero::OutOfMemoryError when the host tier is full too.
  at::Tensor host_empty(int64_t numel, at::ScalarType dtype, bool pin, Kind kind, const std::string& what);

  /// Caps a tier at `nbytes` (<= 0 removes the cap). `config_key` is named in
  /// the out-of-memory message as the setting that would help.
  void set_limit(Tier tier, int64_t nbytes, const std::string& config_key = "");

  LedgerCounter get(Tier tier, Kind kind) const;
  /// Tier totals: current sum over kinds, and the peak of that sum.
  LedgerCounter get(Tier tier) const;
  /// Sum over tiers of the current bytes of one kind.
  int64_t current_bytes(Kind kind) const;

  /// Starts new peaks from the current values.
  void reset_peaks();

  /// The end-of-run table: one row per tier and kind with current and peak,
  /// plus the measured process peak of CPU tensor memory when the counting
  /// allocator is installed.
  std::string summary() const;

 private:
  std::shared_ptr<Shared> shared_;
};

/// Process-wide CPU tensor statistics from the counting allocator.
struct CpuAllocatorStats {
  bool installed = false;
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;
};

/// Wraps LibTorch's CPU allocator with one that counts bytes (idempotent).
/// Tensors allocated before the call are not counted, and are freed normally.
void install_counting_cpu_allocator();
CpuAllocatorStats cpu_allocator_stats();
/// Sets the CPU peak to the current value.
void reset_cpu_allocator_peak();

}  // namespace zero
