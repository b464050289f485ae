// NOTE [parameter swapping] in param_swapper.h.
#include "zero/core/ledger_alloc.h"
#include "zero/partition/param_swapper.h"

#include "zero/partition/stage3_rules.h"

#include <chrono>
#include <cstring>

#include <ATen/ATen.h>

#include "zero/offload/swap_folder.h"
#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::partition {

struct ParamSwapper::Slot {
  char* buf = nullptr;
  int64_t owner = -1;          // the group whose shard it holds (reading, in memory or updating)
  std::vector<offload::AioHandle> io;
  int64_t writing = -1;        // the group it is writing back
  // The group whose shard, as it is on disk (or is being written there), the
  // buffer still holds after it was let go; -1 when none. `stamp` orders
  // these for eviction (NOTE [parameter swapping]).
  int64_t cached = -1;
  int64_t stamp = 0;
  // The last copy out of the buffer to the device (a gather's); the buffer
  // is written again only once it has ended (NOTE [stage-3 gather stream]).
  StreamEvent copied_out;
};

ParamSwapper::ParamSwapper(FlatParameters& params, ParamSwapOptions options, MemoryLedger& ledger)
    : params_(params), options_(std::move(options)) {
  const std::string key = options_.swap.config_key;
  if (options_.swap.buffer_count < 1) {
    throw ConfigError({key + ".buffer_count: expected at least 1 buffer; got " +
                       std::to_string(options_.swap.buffer_count)});
  }
  const auto& info = params_.all_groups();
  groups_.resize(info.size());
  InCpuBudget budget(options_.max_in_cpu);
  ZERO_CHECK(options_.in_memory.empty() || options_.in_memory.size() == info.size(),
             "parameter swapper: the plan's in-memory decisions do not match the groups");
  int64_t largest = 0, elem = 0;
  std::string largest_name;
  const auto& adopted = options_.adopted_offsets;
  ZERO_CHECK(adopted.empty() || (adopted.size() == info.size() && options_.adopted_file != nullptr),
             "parameter swapper: the shards written under zero::Init do not match the groups");
  file_bytes_ = options_.adopted_bytes;  // the other groups go after Init's
  for (size_t g = 1; g < info.size(); ++g) {  // group 0 is always gathered: it stays
    const int64_t n = info[g].chunk_numel;
    const bool on_disk = !adopted.empty() && adopted[g] >= 0;
    const bool in_memory = options_.in_memory.empty() ? budget.keep(n) : options_.in_memory[g];
    if (!on_disk && in_memory) continue;
    auto& gr = groups_[g];
    gr.swapped = true;
    elem = params_.part(g).element_size();
    gr.bytes = offload::aio_aligned(n * elem);
    if (on_disk) {
      gr.offset = adopted[g];
    } else {
      gr.offset = file_bytes_;
      file_bytes_ += gr.bytes;
      gr.resident = true;
    }
    swapped_numel_ += n;
    if (n > largest) largest = n, largest_name = info[g].name;
  }
  if (swapped_numel_ == 0) return;  // everything fits in max_in_cpu
  if (largest > options_.buffer_size) {
    throw ConfigError({key + ".buffer_size: expected at least " + std::to_string(largest) +
                       " elements, the largest parameter shard to swap (layer " + largest_name + "); got " +
                       std::to_string(options_.buffer_size)});
  }
  engine_ = std::make_unique<offload::AioEngine>(options_.swap.aio);
  if (options_.adopted_file != nullptr) {
    file_ = options_.adopted_file;
    file_->reserve(file_bytes_);  // room for the groups not written under Init
  } else {
    file_ = offload::create_swap_files(options_.swap.nvme_path, key + ".nvme_path", options_.swap.tag,
                                       std::to_string(swapped_numel_) + " parameter elements of " + options_.swap.tag,
                                       {{"params.swp", file_bytes_}})
                .front();
  }
  // NOTE [frozen groups]: the frozen shards' part of the file apart.
  int64_t frozen_bytes = 0;
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].swapped && info[g].frozen) frozen_bytes += groups_[g].bytes;
  disk_ = LedgerAlloc::reserve(ledger, Tier::kNvme, Kind::kParameters, file_bytes_ - frozen_bytes,
                               "parameter swap file");
  frozen_disk_ = LedgerAlloc::reserve(ledger, Tier::kNvme, Kind::kFrozenParameters, frozen_bytes,
                                      "parameter swap file (frozen shards)");
  int64_t n_swapped = 0;
  for (const auto& gr : groups_) n_swapped += gr.swapped;
  const int64_t count = std::min(options_.swap.buffer_count, n_swapped);
  const int64_t slot_bytes = offload::aio_aligned(largest * elem);
  buffers_ = SwapBuffers(ledger, options_.swap.pin_memory, count, slot_bytes, Kind::kParameters,
                         "parameter swap buffers", "lower " + key + ".buffer_count");
  for (int64_t i = 0; i < count; ++i) {
    auto s = std::make_unique<Slot>();
    s->buf = buffers_[i];
    slots_.push_back(std::move(s));
  }
}

void ParamSwapper::swap_out() {
  size_t next = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& gr = groups_[g];
    if (!gr.resident) continue;
    gr.resident = false;
    const int slot = static_cast<int>(next++ % slots_.size());
    settle_write(slot);
    settle_copy(slot);
    Slot& s = *slots_[static_cast<size_t>(slot)];
    const at::Tensor& part = params_.part(g);
    std::memcpy(s.buf, part.data_ptr(), part.nbytes());
    s.io.push_back(engine_->write(file_, s.buf, gr.bytes, gr.offset));
    s.writing = static_cast<int64_t>(g);
    gr.pending_write = slot;
    keep_cached(slot, g);
    stats_.bytes_written += gr.bytes;
    empty_part(g);
  }
  for (size_t i = 0; i < slots_.size(); ++i) settle_write(static_cast<int>(i));
}

ParamSwapper::~ParamSwapper() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    try {
      settle_write(static_cast<int>(i));
    } catch (const std::exception& e) {
      log::warning(std::string("a write of the NVMe parameter shards failed after the last step: ") + e.what());
    }
    for (auto& h : slots_[i]->io) {
      try {
        h.wait();
      } catch (...) {
        // a read-ahead nobody will use
      }
    }
  }
}

void ParamSwapper::point_part_at(size_t g, int slot) {
  const at::Tensor& part = params_.part(g);
  part.set_(at::from_blob(slots_[static_cast<size_t>(slot)]->buf, {params_.all_groups()[g].chunk_numel},
                          part.options()));
}

void ParamSwapper::empty_part(size_t g) {
  const at::Tensor& part = params_.part(g);
  part.set_(at::empty({0}, part.options()));
}

// Waits for the write-back in `slot` (if any) and frees the slot.
void ParamSwapper::settle_write(int slot) {
  Slot& s = *slots_[static_cast<size_t>(slot)];
  if (s.writing < 0) return;
  const int64_t g = s.writing;
  s.writing = -1;
  groups_[static_cast<size_t>(g)].pending_write = -1;
  try {
    offload::wait_all(s.io, stats_.write_wait_s);
  } catch (const std::exception& e) {
    if (broken_.empty()) broken_ = e.what();
    throw;
  }
}

int ParamSwapper::cached_slot(size_t g) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i]->cached == static_cast<int64_t>(g)) return static_cast<int>(i);
  return -1;
}

void ParamSwapper::keep_cached(int slot, size_t g) {
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.cached = static_cast<int64_t>(g);
  s.stamp = ++clock_;
}

int ParamSwapper::take_slot(bool may_wait) {
  const int slot = find_slot(may_wait);
  if (slot >= 0) {
    slots_[static_cast<size_t>(slot)]->cached = -1;  // whatever it held is gone
    settle_copy(slot);
  }
  return slot;
}

// The buffer is about to be written: its last copy to the device must be done.
void ParamSwapper::settle_copy(int slot) {
  Slot& s = *slots_[static_cast<size_t>(slot)];
  const auto t0 = std::chrono::steady_clock::now();
  s.copied_out.synchronize();
  s.copied_out = StreamEvent();
  stats_.read_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int ParamSwapper::find_slot(bool may_wait) {
  for (;;) {
    // A free buffer that holds nothing; else the free one cached last: the
    // shards go by in layer order, forward then backward, and the one let go
    // last is the one needed again last (in the next step's backward, or
    // after the rest of this pass), so keeping the older ones saves most reads.
    int best = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = *slots_[i];
      if (s.owner >= 0 || s.writing >= 0) continue;
      if (s.cached < 0) return static_cast<int>(i);
      if (best < 0 || s.stamp > slots_[static_cast<size_t>(best)]->stamp) best = static_cast<int>(i);
    }
    if (best >= 0) return best;
    // Which slot is used never depends on how far the disk has got (see
    // the header): the coordinator's choices, and so the order of every
    // rank's collectives, follow from the layer events alone.
    if (!may_wait) return -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i]->writing >= 0) {
        settle_write(static_cast<int>(i));
        return static_cast<int>(i);
      }
    }
    if (finish_a_gather && finish_a_gather()) continue;
    // Drop a shard that was only read ahead.
    for (size_t i = 0; i < slots_.size(); ++i) {
      const int64_t g = slots_[i]->owner;
      if (g < 0) continue;
      auto& gr = groups_[static_cast<size_t>(g)];
      if (gr.held || gr.updating) continue;
      release(static_cast<size_t>(g));
      return static_cast<int>(i);
    }
    throw Error(ErrorKind::kOutOfMemory, options_.swap.config_key + ".buffer_count: all " +
                                             std::to_string(slots_.size()) +
                                             " parameter swap buffers hold shards in use; raise buffer_count");
  }
}

bool ParamSwapper::start_read(size_t g, bool may_wait) {
  auto& gr = groups_[g];
  if (!gr.swapped || gr.state != State::kOnDisk) return true;
  if (!broken_.empty()) {
    throw IoError("the parameter shards in the NVMe swap file are not the current ones after a failed write (" +
                  broken_ + "); training cannot go on from them: restart from the last checkpoint");
  }
  // The shard's last write-back must be done, even when its buffer still
  // holds the values: a failed write is reported here, not lost.
  if (gr.pending_write >= 0) {
    if (!may_wait) return false;
    settle_write(gr.pending_write);
  }
  if (const int hit = cached_slot(g); hit >= 0) {  // still in a buffer: no read
    Slot& s = *slots_[static_cast<size_t>(hit)];
    s.owner = static_cast<int64_t>(g);
    gr.state = State::kInMemory;
    gr.slot = hit;
    stats_.bytes_cached += gr.bytes;
    point_part_at(g, hit);
    return true;
  }
  const int slot = take_slot(may_wait);
  if (slot < 0) return false;
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.owner = static_cast<int64_t>(g);
  s.io.push_back(engine_->read(file_, s.buf, gr.bytes, gr.offset));
  stats_.bytes_read += gr.bytes;
  gr.state = State::kReading;
  gr.slot = slot;
  return true;
}

void ParamSwapper::wait_read(size_t g) {
  auto& gr = groups_[g];
  if (!gr.swapped) return;
  if (gr.state == State::kOnDisk) start_read(g, true);
  if (gr.state == State::kReading) {
    try {
      offload::wait_all(slots_[static_cast<size_t>(gr.slot)]->io, stats_.read_wait_s);
    } catch (const std::exception&) {
      slots_[static_cast<size_t>(gr.slot)]->owner = -1;  // on disk still: a later read tries again
      gr.slot = -1;
      gr.state = State::kOnDisk;
      throw;
    }
    gr.state = State::kInMemory;
    point_part_at(g, gr.slot);
  }
  gr.held = true;
}

void ParamSwapper::release(size_t g, StreamEvent copied_out) {
  auto& gr = groups_[g];
  if (!gr.swapped || gr.state == State::kOnDisk || gr.updating) return;
  const int slot = gr.slot;
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.copied_out = std::move(copied_out);
  bool whole = true;  // the buffer holds the shard as it is on disk
  if (gr.state == State::kReading) {
    try {
      offload::wait_all(s.io, stats_.read_wait_s);
    } catch (const std::exception&) {
      whole = false;  // nobody used it; a read that matters fails where it is waited for
    }
  }
  s.owner = -1;
  if (whole) keep_cached(slot, g);
  gr.slot = -1;
  gr.state = State::kOnDisk;
  gr.held = false;
  empty_part(g);
}

const at::Tensor& ParamSwapper::begin_update(size_t g) {
  auto& gr = groups_[g];
  ZERO_CHECK(gr.swapped, "begin_update of a group in memory");
  if (gr.state == State::kReading) {
    try {
      offload::wait_all(slots_[static_cast<size_t>(gr.slot)]->io, stats_.read_wait_s);
    } catch (const std::exception&) {
      // a read-ahead: its values are overwritten now anyway
    }
  }
  // The shard's last write-back ends first: its buffer may be the one the new
  // values go into, and two writes of one shard must not race to the file.
  if (gr.pending_write >= 0) settle_write(gr.pending_write);
  if (gr.slot < 0) {
    const int hit = cached_slot(g);
    gr.slot = hit >= 0 ? hit : take_slot(true);
    slots_[static_cast<size_t>(gr.slot)]->owner = static_cast<int64_t>(g);
  }
  slots_[static_cast<size_t>(gr.slot)]->cached = -1;  // being rewritten
  settle_copy(gr.slot);
  gr.state = State::kInMemory;
  gr.updating = true;
  point_part_at(g, gr.slot);
  return params_.part(g);
}

void ParamSwapper::end_update(size_t g) {
  auto& gr = groups_[g];
  ZERO_CHECK(gr.updating, "end_update without begin_update");
  Slot& s = *slots_[static_cast<size_t>(gr.slot)];
  s.io.push_back(engine_->write(file_, s.buf, gr.bytes, gr.offset));
  stats_.bytes_written += gr.bytes;
  s.owner = -1;
  s.writing = static_cast<int64_t>(g);
  keep_cached(gr.slot, g);  // the buffer holds what the file will hold
  gr.pending_write = gr.slot;
  gr.slot = -1;
  gr.state = State::kOnDisk;
  gr.updating = false;
  gr.held = false;
  empty_part(g);
}

}  // namespace zero::partition
