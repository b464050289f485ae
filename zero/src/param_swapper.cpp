// NOTE [parameter swapping] in param_swapper.h.
#include "zero/zero/param_swapper.h"

#include <chrono>
#include <cstring>

#include <ATen/ATen.h>

#include "zero/offload/swap_folder.h"
#include "zero/runtime/error.h"
#include "zero/runtime/log.h"

namespace zero::partition {

struct ParamSwapper::Slot {
  offload::AlignedBuffer buf;
  int64_t owner = -1;          // the group whose shard it holds (reading, in memory or updating)
  std::vector<offload::AioHandle> io;
  int64_t writing = -1;        // the group it is writing back
};

ParamSwapper::ParamSwapper(FlatParameters& params, ParamSwapOptions options, MemoryLedger& ledger)
    : params_(params), options_(std::move(options)) {
  const std::string key = options_.swap.config_key;
  if (options_.swap.buffer_count < 1) {
    throw ConfigError({key + ".buffer_count: expected at least 1 buffer; got " +
                       std::to_string(options_.swap.buffer_count)});
  }
  const auto& info = params_.groups();
  groups_.resize(info.size());
  int64_t budget = std::max<int64_t>(0, options_.max_in_cpu);
  int64_t largest = 0, elem = 0;
  std::string largest_name;
  for (size_t g = 1; g < info.size(); ++g) {  // group 0 is always gathered: it stays
    const int64_t n = info[g].chunk_numel;
    if (n <= budget) {
      budget -= n;
      continue;
    }
    auto& gr = groups_[g];
    gr.swapped = true;
    elem = params_.part(g).element_size();
    gr.offset = file_bytes_;
    gr.bytes = offload::aio_aligned(n * elem);
    file_bytes_ += gr.bytes;
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
  file_ = offload::create_swap_files(options_.swap.nvme_path, key + ".nvme_path", options_.swap.tag,
                                     std::to_string(swapped_numel_) + " parameter elements of " + options_.swap.tag,
                                     {{"params.swp", file_bytes_}})
              .front();
  disk_ = ledger.reserve(Tier::kNvme, Kind::kParameters, file_bytes_, "parameter swap file");
  int64_t n_swapped = 0;
  for (const auto& gr : groups_) n_swapped += gr.swapped;
  const int64_t count = std::min(options_.swap.buffer_count, n_swapped);
  const int64_t slot_bytes = offload::aio_aligned(largest * elem);
  try {
    buffers_ = ledger.reserve(Tier::kHost, Kind::kParameters, slot_bytes * count,
                              std::to_string(count) + " parameter swap buffers of " + format_bytes(slot_bytes));
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(std::string(e.what()) + "; lower " + key + ".buffer_count");
  }
  for (int64_t i = 0; i < count; ++i) {
    auto s = std::make_unique<Slot>();
    s->buf = offload::AlignedBuffer(slot_bytes);
    slots_.push_back(std::move(s));
  }
  // The shards go to disk through the first buffer, one at a time, and leave memory.
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& gr = groups_[g];
    if (!gr.swapped) continue;
    const at::Tensor& part = params_.part(g);
    std::memcpy(slots_[0]->buf.data(), part.data_ptr(), static_cast<size_t>(part.numel() * elem));
    engine_->write(file_, slots_[0]->buf.data(), gr.bytes, gr.offset).wait();
    stats_.bytes_written += gr.bytes;
    empty_part(g);
  }
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
  part.set_(at::from_blob(slots_[static_cast<size_t>(slot)]->buf.data(), {params_.groups()[g].chunk_numel},
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

int ParamSwapper::take_slot(bool may_wait) {
  for (;;) {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i]->owner < 0 && slots_[i]->writing < 0) return static_cast<int>(i);
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
  if (gr.pending_write >= 0) {  // the read must see the shard's last write
    if (!may_wait) return false;
    settle_write(gr.pending_write);
  }
  const int slot = take_slot(may_wait);
  if (slot < 0) return false;
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.owner = static_cast<int64_t>(g);
  s.io.push_back(engine_->read(file_, s.buf.data(), gr.bytes, gr.offset));
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

void ParamSwapper::release(size_t g) {
  auto& gr = groups_[g];
  if (!gr.swapped || gr.state == State::kOnDisk || gr.updating) return;
  Slot& s = *slots_[static_cast<size_t>(gr.slot)];
  if (gr.state == State::kReading) {
    try {
      offload::wait_all(s.io, stats_.read_wait_s);
    } catch (const std::exception&) {
      // nobody used it; a read that matters fails where it is waited for
    }
  }
  s.owner = -1;
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
  if (gr.slot < 0) {
    if (gr.pending_write >= 0) settle_write(gr.pending_write);
    gr.slot = take_slot(true);
    slots_[static_cast<size_t>(gr.slot)]->owner = static_cast<int64_t>(g);
  }
  gr.state = State::kInMemory;
  gr.updating = true;
  point_part_at(g, gr.slot);
  return params_.part(g);
}

void ParamSwapper::end_update(size_t g) {
  auto& gr = groups_[g];
  ZERO_CHECK(gr.updating, "end_update without begin_update");
  Slot& s = *slots_[static_cast<size_t>(gr.slot)];
  s.io.push_back(engine_->write(file_, s.buf.data(), gr.bytes, gr.offset));
  stats_.bytes_written += gr.bytes;
  s.owner = -1;
  s.writing = static_cast<int64_t>(g);
  gr.pending_write = gr.slot;
  gr.slot = -1;
  gr.state = State::kOnDisk;
  gr.updating = false;
  gr.held = false;
  empty_part(g);
}

}  // namespace zero::partition
