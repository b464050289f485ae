// The engine's memory and gathering figures: model-state bytes and peaks
// from the ledger (the device's measured peak beside it), stage 3's
// gathers, the NVMe swappers' traffic, and the end-of-run table.
#include <algorithm>
#include <sstream>

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include "engine_impl.h"
#include "run_reporter.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/text.h"
#include "zero/partition/zero_optimizer.h"
#include "zero/runtime/engine.h"

namespace zero {

ModelStateBytes Engine::model_state_bytes() const {
  const auto& l = impl_->ledger();
  return {l.current_bytes(Kind::kParameters), l.current_bytes(Kind::kGradients),
          l.current_bytes(Kind::kOptimizerStates)};
}

ModelStateBytes Engine::model_state_bytes(Tier tier) const {
  const auto& l = impl_->ledger();
  return {l.get(tier, Kind::kParameters).current_bytes, l.get(tier, Kind::kGradients).current_bytes,
          l.get(tier, Kind::kOptimizerStates).current_bytes};
}

int64_t Engine::peak_bytes(Tier tier) const {
  if (tier != Tier::kDevice) return impl_->ledger().get(tier).peak_bytes;
  return detail::device_peak_bytes(*impl_);
}

int64_t detail::device_peak_bytes(const Engine::Impl& s) {
  const int64_t ledger_peak = s.ledger().get(Tier::kDevice).peak_bytes;
  if (s.device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);  // as apply_memory_budgets
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(s.device.index());
    return std::max<int64_t>(ledger_peak, stats.allocated_bytes[0].peak);
  }
  // The device is the CPU: every CPU tensor counts, less what the ledgers put
  // on the host tiers (NOTE [emulated device memory]).
  if (!cpu_allocator_stats().installed) return ledger_peak;
  return std::max<int64_t>(ledger_peak, cpu_device_stats().peak_bytes);
}

void Engine::reset_peak_bytes() {
  impl_->ledger().reset_peaks();
  if (impl_->device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);  // as apply_memory_budgets
    c10::cuda::CUDACachingAllocator::resetPeakStats(impl_->device.index());
  } else {
    reset_cpu_allocator_peak();
  }
}

std::optional<Stage3Stats> Engine::stage3_stats() const {
  const auto* c = impl_->optimizer->stage3();
  if (c == nullptr) return std::nullopt;
  Stage3Stats st;
  st.layers = static_cast<int64_t>(c->units().size());
  st.live_parameters = c->live_numel();
  st.peak_live_parameters = c->peak_live_numel();
  st.gathers = c->gathers();
  st.prefetched_gathers = c->prefetched_gathers();
  st.gather_wait_s = c->gather_wait_seconds();
  st.trace_valid = c->trace_valid();
  return st;
}

std::optional<NvmeStats> Engine::nvme_stats() const {
  const auto* sw = impl_->optimizer->swapper();
  const auto* ps = impl_->optimizer->param_swapper();
  if (sw == nullptr && ps == nullptr) return std::nullopt;
  NvmeStats out;
  if (sw != nullptr) {
    const auto& x = sw->stats();
    out.file_bytes = sw->file_bytes();
    out.buffer_bytes = sw->buffer_bytes();
    out.bytes_read = x.bytes_read;
    out.bytes_written = x.bytes_written;
    out.read_wait_s = x.read_wait_s;
    out.write_wait_s = x.write_wait_s;
    out.step_s = x.pass_s;
  }
  if (ps != nullptr) {
    out.param_file_bytes = ps->file_bytes();
    out.param_bytes_read = ps->stats().bytes_read;
    out.param_bytes_cached = ps->stats().bytes_cached;
    out.param_bytes_written = ps->stats().bytes_written;
    out.param_read_wait_s = ps->stats().read_wait_s;
  }
  return out;
}

void Engine::reset_stage3_peak() {
  if (auto* c = impl_->optimizer->stage3()) c->reset_peak_live();
}

std::string Engine::memory_summary() const {
  std::ostringstream out;
  out << "memory by tier and kind (ledger):\n" << impl_->ledger().summary();
  out << "measured device peak (" << impl_->device.str() << "): "
      << format_bytes(peak_bytes(Tier::kDevice)) << "\n";
  return out.str();
}

}  // namespace zero
