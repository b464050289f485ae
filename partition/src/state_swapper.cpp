// NOTE [optimizer swapping] in state_swapper.h.
#include "zero/core/text.h"
#include "zero/core/ledger_alloc.h"
#include "zero/partition/state_swapper.h"

#include <chrono>

#include <ATen/ATen.h>

#include "zero/offload/swap_folder.h"
#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::partition {

SwapBuffers::SwapBuffers(MemoryLedger& ledger, bool pin, int64_t count, int64_t bytes, Kind kind,
                         const std::string& what, const std::string& hint)
    : bytes_(bytes) {
  ZERO_CHECK(bytes % offload::kAioAlignment == 0, "swap buffers: size not a multiple of the alignment");
  const int64_t total = count * bytes + offload::kAioAlignment;  // slack to align the first
  try {
    arena_ = LedgerAlloc::host_empty(ledger, total, at::kByte, pin, kind, std::to_string(count) + " " + what + " of " + format_bytes(bytes));
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(std::string(e.what()) + "; " + hint);
  }
  const auto at = reinterpret_cast<uintptr_t>(arena_.data_ptr());
  const auto align = static_cast<uintptr_t>(offload::kAioAlignment);
  base_ = reinterpret_cast<char*>((at + align - 1) / align * align);
}

struct StateSwapper::Slot {
  char* buf = nullptr;
  std::vector<offload::AioHandle> reads, writes;
  int64_t reading = -1;  // the sub-group its reads are for
};

std::vector<int64_t> sub_groups_of(const std::vector<int64_t>& group_numels, int64_t sub_group_size) {
  const int64_t size = std::max<int64_t>(1, sub_group_size);
  std::vector<int64_t> out;
  for (int64_t n : group_numels)
    for (int64_t start = 0; start < n; start += size) out.push_back(std::min(size, n - start));
  return out;
}

namespace {
std::vector<SwapTensor> fp32_tensors(const std::vector<std::string>& names) {
  std::vector<SwapTensor> t;
  for (const auto& n : names) t.push_back({n, at::kFloat, 0});
  return t;
}
}  // namespace

StateSwapper::StateSwapper(std::vector<int64_t> sub_groups, std::vector<std::string> names, SwapOptions options,
                           MemoryLedger& ledger)
    : StateSwapper(std::move(sub_groups), fp32_tensors(names), std::move(options), ledger) {}

int64_t StateSwapper::bytes_of(size_t i, size_t k) const {
  const SwapTensor& t = tensors_[i];
  return offload::aio_aligned(t.numel_of(k, sub_groups_[k]) * static_cast<int64_t>(c10::elementSize(t.dtype)));
}

StateSwapper::StateSwapper(std::vector<int64_t> sub_groups, std::vector<SwapTensor> tensors, SwapOptions options,
                           MemoryLedger& ledger)
    : sub_groups_(std::move(sub_groups)), tensors_(std::move(tensors)), options_(std::move(options)) {
  ZERO_CHECK(!tensors_.empty(), "state swapper: no tensors");
  if (options_.buffer_count < 1) {
    throw ConfigError({options_.config_key + ".buffer_count: expected at least 1 buffer; got " +
                       std::to_string(options_.buffer_count)});
  }
  int64_t slot_bytes = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    int64_t total = 0, widest = offload::kAioAlignment;
    offsets_.emplace_back();
    for (size_t k = 0; k < sub_groups_.size(); ++k) {
      offsets_[i].push_back(total);
      total += bytes_of(i, k);
      widest = std::max(widest, bytes_of(i, k));
    }
    file_size_.push_back(total);
    slot_at_.push_back(slot_bytes);
    slot_bytes += widest;
  }
  engine_ = std::make_unique<offload::AioEngine>(options_.aio);
  std::vector<offload::SwapFileSpec> specs;
  for (size_t i = 0; i < tensors_.size(); ++i) specs.push_back({tensors_[i].name + ".swp", file_size_[i]});
  int64_t numel = 0;
  for (int64_t n : sub_groups_) numel += n;
  files_ = offload::create_swap_files(options_.nvme_path, options_.config_key + ".nvme_path", options_.tag,
                                      std::to_string(numel) + " optimizer elements (" +
                                          std::to_string(tensors_.size()) + " state tensors) of " + options_.tag,
                                      specs);
  disk_ = LedgerAlloc::reserve(ledger, Tier::kNvme, Kind::kOptimizerStates, file_bytes(), "optimizer swap files");
  // Never more buffers than sub-groups: a small model does not pay for four.
  const int64_t count = std::min<int64_t>(options_.buffer_count, std::max<size_t>(1, sub_groups_.size()));
  buffers_ = SwapBuffers(ledger, options_.pin_memory, count, slot_bytes, Kind::kOptimizerStates,
                         "NVMe swap buffers",
                         "lower zero_optimization.sub_group_size (each buffer holds one sub-group of every state) or " +
                             options_.config_key + ".buffer_count");
  for (int64_t i = 0; i < count; ++i) {
    auto s = std::make_unique<Slot>();
    s->buf = buffers_[i];
    slots_.push_back(std::move(s));
  }
}

StateSwapper::~StateSwapper() {
  for (auto& s : slots_) {
    try {
      wait_writes(*s);
    } catch (const std::exception& e) {
      // The swap files go with this object; the model's parameters are whole.
      log::warning(std::string("a write of the NVMe optimizer states failed after the last step: ") + e.what());
    }
  }
  drain();
}

int64_t StateSwapper::file_bytes() const {
  int64_t total = 0;
  for (int64_t f : file_size_) total += f;
  return total;
}

void StateSwapper::clear_timings() {
  stats_.read_wait_s = stats_.write_wait_s = stats_.pass_s = 0;
  stats_.passes = 0;
}

int64_t StateSwapper::buffer_bytes() const { return buffers_.total_bytes(); }

at::Tensor StateSwapper::tensor_in(Slot& s, size_t i, size_t k) const {
  const SwapTensor& t = tensors_[i];
  return at::from_blob(s.buf + slot_at_[i], {t.numel_of(k, sub_groups_[k])}, at::TensorOptions().dtype(t.dtype));
}

void StateSwapper::start_read(size_t k) {
  Slot& s = *slots_[k % slots_.size()];
  if (s.reading == static_cast<int64_t>(k)) return;  // already on its way (prefetch)
  wait_reads(s);   // a read of another sub-group that was not used
  wait_writes(s);  // the buffer's last sub-group must be on disk first
  for (size_t i = 0; i < files_.size(); ++i) {
    const int64_t len = bytes_of(i, k);
    s.reads.push_back(engine_->read(files_[i], s.buf + slot_at_[i], len, offsets_[i][k]));
    stats_.bytes_read += len;
  }
  s.reading = static_cast<int64_t>(k);
}

void StateSwapper::wait_reads(Slot& s) {
  s.reading = -1;
  offload::wait_all(s.reads, stats_.read_wait_s);
}

// A failed write leaves its sub-group half-written on disk: the files are no
// longer one consistent state, whichever pass notices it.
void StateSwapper::wait_writes(Slot& s) {
  try {
    offload::wait_all(s.writes, stats_.write_wait_s);
  } catch (const std::exception& e) {
    if (broken_.empty()) broken_ = e.what();
    throw;
  }
}

void StateSwapper::prefetch() {
  if (!options_.pipeline_read || !broken_.empty()) return;
  try {
    for (size_t k = 0; k < std::min(sub_groups_.size(), slots_.size()); ++k) start_read(k);
  } catch (const std::exception&) {
    // a write that failed: recorded in broken_, reported by the next pass
  }
}

void StateSwapper::drain() noexcept {
  for (auto& s : slots_) {
    for (auto* hs : {&s->reads, &s->writes}) {
      for (auto& h : *hs) {
        try {
          h.wait();
        } catch (...) {
          // the pass that issued it has already failed
        }
      }
      hs->clear();
    }
    s->reading = -1;
  }
}

void StateSwapper::pass(bool read, bool write, const Visit& visit) {
  if (!broken_.empty()) {
    throw IoError("the optimizer states in the NVMe swap files are inconsistent after an earlier I/O error (" +
                  broken_ + "); training cannot go on from them: restart from the last checkpoint");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const size_t n = sub_groups_.size(), b = slots_.size();
  // Reads in flight beyond the sub-group being visited: every buffer but its
  // own, and but the one still writing the previous sub-group.
  size_t ahead = 0;
  if (read && options_.pipeline_read) ahead = b > 1 ? b - 1 - (options_.pipeline_write && b > 2 ? 1 : 0) : 0;
  bool wrote = false;
  try {
    for (size_t k = 0; read && k < std::min(n, ahead); ++k) start_read(k);
    for (size_t k = 0; k < n; ++k) {
      if (read && k + ahead < n && ahead > 0) start_read(k + ahead);
      Slot& s = *slots_[k % b];
      if (read) start_read(k);  // (unless it is on its way)
      wait_reads(s);            // without `read`: one the visit would overwrite
      wait_writes(s);
      std::vector<at::Tensor> tensors;
      for (size_t i = 0; i < files_.size(); ++i) tensors.push_back(tensor_in(s, i, k));
      visit(k, tensors);
      if (!write) continue;
      for (size_t i = 0; i < files_.size(); ++i) {
        const int64_t len = bytes_of(i, k);
        s.writes.push_back(engine_->write(files_[i], s.buf + slot_at_[i], len, offsets_[i][k]));
        stats_.bytes_written += len;
      }
      wrote = true;
      if (!options_.pipeline_write) wait_writes(s);
    }
    // pipeline_write: the last writes go on behind the next forward and
    // backward; whatever next uses their buffer waits for them.
    if (!options_.pipeline_write)
      for (auto& s : slots_) wait_writes(*s);
  } catch (const std::exception& e) {
    drain();
    if (wrote && broken_.empty()) broken_ = e.what();
    throw;
  }
  stats_.pass_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.passes;
}

}  // namespace zero::partition
