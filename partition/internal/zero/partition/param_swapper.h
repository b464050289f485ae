// Stage 3's parameter partitions on NVMe (offload_param.device = nvme).
//
// NOTE [parameter swapping]
// Each layer group's shard (this rank's chunk, in the compute dtype) has a
// 4 KiB-aligned place in one swap file (NOTE [swap files]). Groups stay in
// host memory, in order, while their elements total at most
// offload_param.max_in_cpu (and group 0, the always-gathered one, always);
// the rest live on disk and come into one of `buffer_count` buffers of
// `buffer_size` elements when needed. A model built under zero::Init has its
// shards beyond max_in_cpu written to the file as each layer is built (host
// memory never holds the partition); the swapper takes that file over
// (ParamSwapOptions::adopted_*). Otherwise it writes them at the start,
// through its buffers.
//   - for a gather: the coordinator starts the read when it issues the
//     group's all-gather, or earlier, following the stage-3 trace, for the
//     layers after the prefetch window (as many as there are free buffers;
//     none when stage3_prefetch_bucket_size is 0, prefetch off). An issued
//     gather is queued and launched at the next layer event or when it is
//     waited for, so a prefetched shard has a layer's time to arrive. The
//     buffer is given back once the all-gather has sent the shard;
//   - for the optimizer step: the step writes the new 16-bit values into a
//     buffer (no read: it overwrites the whole shard), then writes it back;
//     the buffer is free once that write is done, and a later read of the
//     group waits for it.
// part(g) of a group on disk is an empty tensor; while the shard is in a
// buffer, part(g) is that buffer.
// A buffer let go (its shard sent, or its write-back issued) keeps the shard
// as it is on disk, and a later read of that group uses it instead of the
// disk. A read takes a buffer holding nothing if there is one, else the one
// let go most recently: shards go by in layer order, forward then backward,
// so the one let go last is the one needed again last, and keeping the
// others is what saves reads (at the turn from forward to backward, the last
// layers are still in the buffers). A buffer that is needed while all are in
// use is freed by finishing a write, then an all-gather in flight (the
// coordinator's), then by dropping a shard that was only read ahead.
// None of these choices looks at how far a transfer has got: ranks whose
// disks run at different speeds still make the same choices, so they launch
// the same collectives in the same order. (A read-ahead never waits: it
// takes only a buffer that is free, and skips a shard still being written.)
// A failed read fails the gather that waits for it, naming the file, offset
// and errno, and leaves the shard on disk to be read again. A failed
// write-back leaves an older shard in the file: that error is reported where
// the write is waited for, and every later read refuses (the model would
// silently go back a step).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zero/offload/aio.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/state_swapper.h"

namespace zero::partition {

struct ParamSwapOptions {
  SwapOptions swap;                  // nvme_path, buffer_count, aio; config_key "zero_optimization.offload_param"
  int64_t buffer_size = 100000000;   // elements per buffer
  int64_t max_in_cpu = 1000000000;   // elements kept in host memory
  /// Per group: whether its shard stays in host memory, as the stage-3 plan
  /// decided (NOTE [stage-3 plan]); empty: decided here from max_in_cpu, by
  /// the same rule (InCpuBudget, in group order).
  std::vector<bool> in_memory;
  /// Shards zero::Init already wrote as their layers were built (their
  /// groups' GroupSpec::chunk_on_disk): the file, its length, and each
  /// group's offset in it (-1: not written there). The swapper keeps them
  /// where they are, and puts the other groups beyond max_in_cpu after them.
  std::shared_ptr<offload::AioFile> adopted_file;
  int64_t adopted_bytes = 0;
  std::vector<int64_t> adopted_offsets;
};

class ParamSwapper {
 public:
  /// Decides which groups go to disk, checks the buffers can hold each of
  /// them, creates (or adopts) the file and the buffers. The shards still in
  /// host memory stay there, readable as ever, until swap_out(). Throws
  /// zero::ConfigError (buffer_size too small, bad path), zero::IoError,
  /// zero::OutOfMemoryError.
  ParamSwapper(FlatParameters& params, ParamSwapOptions options, MemoryLedger& ledger);
  ~ParamSwapper();
  ParamSwapper(const ParamSwapper&) = delete;
  ParamSwapper& operator=(const ParamSwapper&) = delete;

  /// Writes the shards bound for disk that are still in host memory, with up
  /// to buffer_count writes in flight, and frees their memory; each buffer
  /// keeps the shard it wrote. (Separate from the constructor so that the
  /// start-up can read them, for the fp32 master, before they leave.)
  void swap_out();
  bool on_disk(size_t g) const { return groups_[g].swapped && !groups_[g].resident; }
  /// Starts reading group g's shard unless it is in memory or on its way.
  /// `may_wait` false (read-ahead): returns false instead of waiting for a
  /// buffer. Returns true when the shard is in memory or on its way.
  bool start_read(size_t g, bool may_wait);
  /// Keeps g's shard (read or being read) from being dropped to free a
  /// buffer: a gather has been issued for it. release(g) ends it.
  void hold(size_t g) { groups_[g].held = groups_[g].swapped; }
  /// Waits for the read; part(g) then holds the shard until release(g).
  void wait_read(size_t g);
  /// The shard is not needed in memory any more (it is unchanged on disk).
  /// `copied_out`: the end of the copy of the shard to the device (a
  /// gather's); its buffer is written again only after it (NOTE [stage-3 gather stream]).
  void release(size_t g, StreamEvent copied_out = StreamEvent());
  /// The step: part(g) becomes a buffer for the new values (contents
  /// undefined: the caller writes all of it).
  const at::Tensor& begin_update(size_t g);
  /// Writes part(g) back and releases it when the write is done.
  void end_update(size_t g);
  /// Called when every buffer is taken: finishes an all-gather that holds
  /// one (see NOTE); returns false when there is none.
  std::function<bool()> finish_a_gather;

  /// Test seam: the engine, to inject faults.
  offload::AioEngine& engine_for_testing() { return *engine_; }

  int64_t file_bytes() const { return file_bytes_; }
  int64_t swapped_numel() const { return swapped_numel_; }
  const SwapStats& stats() const { return stats_; }
  /// Sets the wait times to zero (after the start-up, which reads shards for
  /// the fp32 master); the byte counts stay.
  void clear_timings() { stats_.read_wait_s = stats_.write_wait_s = 0; }

 private:
  enum class State { kOnDisk, kReading, kInMemory };
  struct Group {
    bool swapped = false;
    bool resident = false;   // swapped, but still in host memory until swap_out()
    State state = State::kOnDisk;
    int slot = -1;
    int64_t offset = 0;  // in the file
    int64_t bytes = 0;   // aligned transfer length
    int pending_write = -1;  // slot whose write of this group is in flight
    bool held = false;       // between wait_read and release: an all-gather sends it
    bool updating = false;
  };
  struct Slot;
  int take_slot(bool may_wait);
  int find_slot(bool may_wait);
  int cached_slot(size_t g) const;
  void keep_cached(int slot, size_t g);
  void settle_write(int slot);
  void settle_copy(int slot);
  void point_part_at(size_t g, int slot);
  void empty_part(size_t g);

  FlatParameters& params_;
  ParamSwapOptions options_;
  std::vector<Group> groups_;
  std::vector<std::unique_ptr<Slot>> slots_;
  // Declared before the engine: the engine, destroyed first, waits for every
  // transfer in flight before the buffers go.
  SwapBuffers buffers_;
  std::unique_ptr<offload::AioEngine> engine_;
  std::shared_ptr<offload::AioFile> file_;
  LedgerReservation disk_, frozen_disk_;
  int64_t file_bytes_ = 0, swapped_numel_ = 0;
  int64_t clock_ = 0;  // orders the cached buffers
  SwapStats stats_;
  std::string broken_;  // a failed write-back: the file holds an older shard
};

}  // namespace zero::partition
