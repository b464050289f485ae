// The memory ledger: every buffer the engine allocates, by tier and kind,
// with current and peak bytes, and optional per-tier limits. This is its
// read side and its limits; the engine allocates through it with LedgerAlloc
// (NOTE [memory ledger], zero/core/ledger_alloc.h, internal). All methods are
// thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>


namespace zero {

/// Where a buffer lives: device memory, page-locked (pinned) host memory,
/// pageable host memory, or an NVMe swap file.
enum class Tier { kDevice = 0, kPinnedHost, kHost, kNvme };
/// What a buffer holds, as the ledger counts it.
/// kFrozenParameters: parameters that do not train (requires_grad false: a
/// LoRA base), whole or in stage 3's shards (NOTE [frozen groups]); they are
/// not model states (no gradient, master or optimizer state).
enum class Kind { kParameters = 0, kGradients, kOptimizerStates, kActivations, kCommBuffers, kFrozenParameters };
inline constexpr int kNumTiers = 4;  ///< Number of Tier values.
inline constexpr int kNumKinds = 6;  ///< Number of Kind values.

const char* to_string(Tier tier);  ///< "device", "pinned_host", "host", "nvme"
const char* to_string(Kind kind);  ///< "parameters", "gradients", ..., "frozen_parameters"

/// The bytes counted in one place of the ledger (a tier and kind, a tier, or
/// the host tiers together).
struct LedgerCounter {
  int64_t current_bytes = 0;  ///< Bytes held now.
  int64_t peak_bytes = 0;     ///< Most bytes held at once since the ledger was made or reset_peaks().
};

/// Counts the engine's buffers by tier and kind (current and peak bytes) and
/// enforces the limits set with set_limit() and set_host_limit(). Not
/// copyable. All methods are thread-safe.
class MemoryLedger {
 public:
  /// An empty ledger with no limits; page locking on (device 0) where CUDA
  /// is present.
  MemoryLedger();
  /// Buffers still allocated through it keep its counters alive and take
  /// their bytes off them when freed.
  ~MemoryLedger();
  /// Not copyable.
  MemoryLedger(const MemoryLedger&) = delete;
  /// Not copyable.
  MemoryLedger& operator=(const MemoryLedger&) = delete;

  /// Caps a tier at `nbytes` (<= 0 removes the cap): an allocation that would
  /// pass it throws zero::OutOfMemoryError naming what was needed, what is in
  /// use, the limit and `config_key` (the setting that would help).
  void set_limit(Tier tier, int64_t nbytes, const std::string& config_key = "");
  /// Caps the pinned and pageable host tiers together (each tier's own cap
  /// still applies): a pinned buffer refused by this cap does not fall back
  /// to pageable memory, it is out of host memory.
  void set_host_limit(int64_t nbytes, const std::string& config_key = "");

  /// Whether the pinned tier is page-locked memory of CUDA device
  /// `cuda_device` (NOTE [pinned host memory]) or ordinary host memory
  /// counted as pinned. The engine turns it on for a CUDA run only; a new
  /// ledger has it on (device 0) where CUDA is present.
  void set_page_locking(bool on, int cuda_device = 0);

  /// One kind's bytes on one tier: current and peak.
  LedgerCounter get(Tier tier, Kind kind) const;
  /// Tier totals: current sum over kinds, and the peak of that sum.
  LedgerCounter get(Tier tier) const;
  /// The pinned and pageable host tiers together: their sum now and its
  /// peak (not the sum of their peaks, which may come at different times).
  LedgerCounter host_total() const;
  /// Sum over tiers of the current bytes of one kind.
  int64_t current_bytes(Kind kind) const;

  /// Starts new peaks from the current values.
  void reset_peaks();

  /// The end-of-run table: one row per tier and kind with current and peak
  /// (rows whose peak is 0 left out) and a total row per tier,
  /// plus the measured process peak of CPU tensor memory when the counting
  /// allocator is installed.
  std::string summary() const;

  struct Shared;  // the counters, shared with the buffers counted (opaque)

 private:
  friend class LedgerAlloc;
  std::shared_ptr<Shared> shared_;
};

}  // namespace zero
