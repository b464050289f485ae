// The owned partition's master and optimizer states in NVMe swap files,
// stepped sub-group by sub-group through a few host buffers.
//
// NOTE [optimizer swapping]
// With offload_optimizer.device = nvme, each state tensor of the owned
// partition (the master, fp32 or 16-bit, then the optimizer's states: exp_avg,
// exp_avg_sq for Adam) is one swap file (NOTE [swap files]). The partition is
// cut into sub-groups of at most sub_group_size elements; sub-group k sits at
// a 4 KiB-aligned offset in every file, so each transfer is O_DIRECT. A
// tensor may be of another dtype or one element per block (8-bit Adam's
// codes and scales, NOTE [8-bit states]): its file is that much smaller.
// A pass visits the sub-groups in order through `buffer_count` host buffers
// (pinned with pin_memory, see SwapBuffers), each holding all the tensors of
// one sub-group:
//     read k  ->  visit k (the CPU optimizer steps it)  ->  write k back
// pipeline_read reads ahead: while sub-group k is visited, the reads of the
// next ones are in flight (as many as the free buffers allow).
// pipeline_write lets k's writes run while k+1 is visited; a buffer is reused
// only once its writes are done. Without them the phases run one after
// another, as in DeepSpeed. The bytes round-trip exactly.
// Across steps, too: with pipeline_write the last sub-groups' writes finish
// behind the next forward, and with pipeline_read the engine calls
// prefetch() as backward starts, which reads the first sub-groups (one per
// buffer) behind backward, so a step starts with them in memory.
//
// An I/O error fails the pass with the file, offset, length and errno. If a
// write had been issued in that pass, the files now mix updated and old
// sub-groups: the swapper refuses every later pass (naming the first error)
// rather than train on states that are silently wrong.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/offload/aio.h"
#include "zero/core/ledger_alloc.h"

namespace zero::partition {

struct SwapOptions {
  std::string nvme_path;
  /// The config section, named in errors ("zero_optimization.offload_optimizer").
  std::string config_key = "zero_optimization.offload_optimizer";
  int64_t buffer_count = 4;
  /// The section's pin_memory: the swap buffers are page-locked host memory
  /// (see SwapBuffers).
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  offload::AioOptions aio;
  /// Distinguishes the folders of ranks sharing a disk ("rank0").
  std::string tag = "rank0";
};

/// The host buffers a swapper moves data through: `count` of `bytes` each (a
/// multiple of offload::kAioAlignment) in one allocation, each aligned for
/// O_DIRECT. With `pin`, page-locked (the ledger's pinned tier; the copies
/// between these buffers and a GPU then need no staging), falling back to
/// pageable memory with a warning when the pinned limit is reached, as other
/// offloaded state does. Counted on the ledger while this object lives.
/// Throws zero::OutOfMemoryError, with `hint` (the config keys that shrink
/// the buffers) appended.
class SwapBuffers {
 public:
  SwapBuffers() = default;
  SwapBuffers(MemoryLedger& ledger, bool pin, int64_t count, int64_t bytes, Kind kind, const std::string& what,
              const std::string& hint);
  char* operator[](int64_t i) const { return base_ + i * bytes_; }
  /// All of them, as counted on the ledger (with the alignment slack).
  int64_t total_bytes() const { return arena_.defined() ? arena_.numel() : 0; }

 private:
  at::Tensor arena_;
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

/// Totals since construction.
struct SwapStats {
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t bytes_cached = 0;  // reads saved: the data was still in a buffer
  double read_wait_s = 0;   // waiting for reads (not hidden behind the visits)
  double write_wait_s = 0;  // waiting for writes (ditto)
  double pass_s = 0;        // in passes, visits included
  int64_t passes = 0;
};

/// One swapped tensor: its name (the file is "<name>.swp"), dtype and
/// length for a sub-group of n elements (n, or ceil(n / per_block)).
struct SwapTensor {
  SwapTensor(std::string name_, at::ScalarType dtype_, int64_t per_block_)  // (all three: a bare name is fp32's overload)
      : name(std::move(name_)), dtype(dtype_), per_block(per_block_) {}
  std::string name;
  at::ScalarType dtype = at::kFloat;
  int64_t per_block = 0;
  /// When given: each sub-group's length, in order (8-bit Adam's fp32 blocks).
  std::vector<int64_t> numels;
  int64_t numel_for(int64_t n) const { return per_block > 0 ? (n + per_block - 1) / per_block : n; }
  int64_t numel_of(size_t k, int64_t n) const { return numels.empty() ? numel_for(n) : numels.at(k); }
};

class StateSwapper {
 public:
  /// `sub_groups`: the elements of each sub-group, in order; `names`: one
  /// fp32 tensor (and file) per name. Checks the path and the free space,
  /// creates the files and the buffers (counted in `ledger`: the files on the
  /// NVMe tier, the buffers on the host tier). Throws zero::ConfigError for a
  /// bad path or option, zero::IoError for too little space or a failed file,
  /// zero::OutOfMemoryError past the host tier's limit.
  StateSwapper(std::vector<int64_t> sub_groups, std::vector<std::string> names, SwapOptions options,
               MemoryLedger& ledger);
  /// The same with each tensor's dtype and length (SwapTensor).
  StateSwapper(std::vector<int64_t> sub_groups, std::vector<SwapTensor> tensors, SwapOptions options,
               MemoryLedger& ledger);
  /// Waits for the I/O in flight.
  ~StateSwapper();
  StateSwapper(const StateSwapper&) = delete;
  StateSwapper& operator=(const StateSwapper&) = delete;

  /// `tensors[i]`: sub-group k's tensor of tensor i (fp32 unless its
  /// SwapTensor says otherwise), in a host buffer.
  using Visit = std::function<void(size_t k, const std::vector<at::Tensor>& tensors)>;
  /// Visits every sub-group in order. `read`: the tensors hold the values on
  /// disk (false: uninitialised, for the visit to fill). `write`: written
  /// back after the visit. Throws zero::IoError (see NOTE).
  void pass(bool read, bool write, const Visit& visit);

  /// pipeline_read: starts reading the first sub-groups (one per buffer) for
  /// the next pass, so that they arrive behind other work (the engine calls
  /// it as backward starts). Never throws: a failure surfaces in the pass.
  void prefetch();

  size_t num_sub_groups() const { return sub_groups_.size(); }
  int64_t sub_group_numel(size_t k) const { return sub_groups_[k]; }
  /// Bytes of all swap files together.
  int64_t file_bytes() const;
  /// Bytes of the host buffers.
  int64_t buffer_bytes() const;
  const SwapStats& stats() const { return stats_; }
  /// Zeroes the times and the pass count (the byte counts stay): the
  /// engine's figures then leave out the initial write of the states.
  void clear_timings();
  const SwapOptions& options() const { return options_; }
  /// Test seam: the engine, to inject faults.
  offload::AioEngine& engine_for_testing() { return *engine_; }

 private:
  struct Slot;
  void start_read(size_t k);
  void wait_reads(Slot& s);
  void wait_writes(Slot& s);
  void drain() noexcept;
  at::Tensor tensor_in(Slot& s, size_t i, size_t k) const;
  int64_t bytes_of(size_t i, size_t k) const;  // tensor i's sub-group k on disk, aligned

  std::vector<int64_t> sub_groups_;
  std::vector<SwapTensor> tensors_;
  std::vector<std::vector<int64_t>> offsets_;  // bytes: [tensor][sub-group] in the tensor's file
  std::vector<int64_t> file_size_;             // bytes of each tensor's file
  std::vector<int64_t> slot_at_;               // bytes: where each tensor's region starts in a buffer
  SwapOptions options_;
  // Declared before the engine: the engine, destroyed first, waits for every
  // transfer in flight before the buffers go.
  SwapBuffers buffers_;
  std::unique_ptr<offload::AioEngine> engine_;
  std::vector<std::shared_ptr<offload::AioFile>> files_;
  std::vector<std::unique_ptr<Slot>> slots_;
  LedgerReservation disk_;
  SwapStats stats_;
  std::string broken_;  // the error that left the files inconsistent
};

/// Sub-groups of at most `sub_group_size` elements over `group_numels`
/// (a sub-group never spans two groups).
std::vector<int64_t> sub_groups_of(const std::vector<int64_t>& group_numels, int64_t sub_group_size);

}  // namespace zero::partition
