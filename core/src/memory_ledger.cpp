#include "zero/core/memory_ledger.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/text.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <c10/core/impl/alloc_cpu.h>

#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero {

const char* to_string(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinnedHost: return "pinned_host";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

const char* to_string(Kind kind) {
  switch (kind) {
    case Kind::kParameters: return "parameters";
    case Kind::kGradients: return "gradients";
    case Kind::kOptimizerStates: return "optimizer_states";
    case Kind::kActivations: return "activations";
    case Kind::kCommBuffers: return "comm_buffers";
    case Kind::kFrozenParameters: return "frozen_parameters";
  }
  return "?";
}


namespace {
// Bytes on the pinned and pageable host tiers of every ledger in the process:
// CPU tensor memory that is not a CPU run's device memory
// (NOTE [emulated device memory]).
std::atomic<int64_t> g_host_tier_bytes{0};
bool is_host(Tier t) { return t == Tier::kPinnedHost || t == Tier::kHost; }
}  // namespace

struct MemoryLedger::Shared {
  mutable std::mutex mu;
  std::array<std::array<LedgerCounter, kNumKinds>, kNumTiers> cells{};
  std::array<LedgerCounter, kNumTiers> tiers{};
  std::array<int64_t, kNumTiers> limits{};
  std::array<std::string, kNumTiers> limit_keys;
  int64_t host_limit = 0;  // pinned + pageable
  LedgerCounter host_total;  // pinned + pageable: now, and the peak of the sum
  std::string host_limit_key;
  // The CUDA device whose run page-locks the pinned tier (NOTE [pinned host
  // memory]), or -1: a CPU run's pinned tier is host memory.
  std::atomic<int> page_lock_device{at::globalContext().hasCUDA() ? 0 : -1};

  [[noreturn]] static void refuse(const std::string& where, const std::string& what, int64_t n, int64_t used,
                                  int64_t limit, const std::string& key) {
    std::ostringstream m;
    m << "out of memory on the " << where << ": " << what << " needs " << format_bytes(n) << ", "
      << format_bytes(used) << " already in use, limit " << format_bytes(limit);
    if (!key.empty()) m << " (set by " << key << ")";
    throw OutOfMemoryError(m.str());
  }

  void add(Tier t, Kind k, int64_t n, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    auto& tier = tiers[static_cast<int>(t)];
    int64_t limit = limits[static_cast<int>(t)];
    if (limit > 0 && tier.current_bytes + n > limit)
      refuse(std::string(to_string(t)) + " tier", what, n, tier.current_bytes, limit, limit_keys[static_cast<int>(t)]);
    if (is_host(t) && host_limit > 0) {
      const int64_t host = tiers[static_cast<int>(Tier::kPinnedHost)].current_bytes +
                           tiers[static_cast<int>(Tier::kHost)].current_bytes;
      if (host + n > host_limit) refuse("host (pinned and pageable)", what, n, host, host_limit, host_limit_key);
    }
    auto& cell = cells[static_cast<int>(t)][static_cast<int>(k)];
    cell.current_bytes += n;
    cell.peak_bytes = std::max(cell.peak_bytes, cell.current_bytes);
    tier.current_bytes += n;
    tier.peak_bytes = std::max(tier.peak_bytes, tier.current_bytes);
    if (is_host(t)) {
      g_host_tier_bytes.fetch_add(n, std::memory_order_relaxed);
      host_total.current_bytes += n;
      host_total.peak_bytes = std::max(host_total.peak_bytes, host_total.current_bytes);
    }
  }
  void sub(Tier t, Kind k, int64_t n) {
    std::lock_guard<std::mutex> lock(mu);
    cells[static_cast<int>(t)][static_cast<int>(k)].current_bytes -= n;
    tiers[static_cast<int>(t)].current_bytes -= n;
    if (is_host(t)) {
      g_host_tier_bytes.fetch_sub(n, std::memory_order_relaxed);
      host_total.current_bytes -= n;
    }
  }
};

MemoryLedger::MemoryLedger() : shared_(std::make_shared<Shared>()) {}
MemoryLedger::~MemoryLedger() = default;

// NOTE [pinned host memory]
// The pinned tier of a CUDA run is page-locked host memory. The long-lived
// buffers (states, gradient and parameter partitions, staging rings, swap
// arenas) are exactly the size asked, from cudaHostAlloc: LibTorch's pinned
// allocator (at::empty with pinned_memory, Tensor::pin_memory) rounds every
// block up to a power of two, so a 9 GiB partition of optimizer states would
// hold 16 GiB, and its caching buys nothing for buffers made once. They are
// freed after the device has finished its work (cudaDeviceSynchronize; few
// frees, at the end of a run), so no copy still in flight reads freed memory
// (CopyStream also keeps a copy's tensors alive until its event). A
// cudaHostAlloc that fails is an OutOfMemoryError: host_empty then uses
// pageable memory. Activations (cpu_checkpointing's kept inputs, made and
// freed every micro-step) stay with LibTorch's caching pinned allocator,
// whose reuse avoids a page-locking and a device-wide wait per buffer. Both
// run under the engine's device (CUDAGuard), from whichever thread. A CPU
// run's pinned tier is ordinary host memory, counted as pinned_host
// (MemoryLedger::set_page_locking).
at::Tensor LedgerAlloc::empty(MemoryLedger& ledger, int64_t numel, at::ScalarType dtype, at::Device device, Tier tier,
                               Kind kind, const std::string& what) {
  ZERO_CHECK(numel >= 0, what);
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  auto options = at::TensorOptions().dtype(dtype).device(device);
  if (numel == 0) return at::empty({0}, options);  // nothing to count (and no pointer for from_blob)
  ledger.shared_->add(tier, kind, nbytes, what);
  auto state = ledger.shared_;
  const int cuda_device = ledger.shared_->page_lock_device.load();
  const bool pin = tier == Tier::kPinnedHost && device.is_cpu() && cuda_device >= 0;
  if (pin && kind != Kind::kActivations) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device));
    void* data = nullptr;
    const cudaError_t err = cudaHostAlloc(&data, static_cast<size_t>(nbytes), cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the run goes on (pageable memory)
      ledger.shared_->sub(tier, kind, nbytes);
      throw OutOfMemoryError("cannot page-lock " + format_bytes(nbytes) + " of host memory for " + what +
                             ": cudaHostAlloc: " + cudaGetErrorString(err));
    }
    auto free_pinned = [state, tier, kind, nbytes, cuda_device](void* p) {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(cuda_device));
      (void)cudaDeviceSynchronize();  // no copy in flight reads it any more
      (void)cudaFreeHost(p);          // freed first: the ledger never shows memory that is still held
      (void)cudaGetLastError();
      state->sub(tier, kind, nbytes);
    };
    try {
      return at::from_blob(data, {numel}, free_pinned, options);
    } catch (...) {
      free_pinned(data);
      throw;
    }
  }
  if (pin) options = options.pinned_memory(true);
  at::Tensor raw;
  try {
    raw = at::empty({numel}, options);
  } catch (...) {
    ledger.shared_->sub(tier, kind, nbytes);
    throw;
  }
  // The returned tensor shares raw's memory; its deleter keeps raw alive and
  // takes the bytes off the ledger when the last user lets go.
  void* data = raw.data_ptr();
  return at::from_blob(
      data, {numel},
      [raw, state, tier, kind, nbytes](void*) mutable {
        raw.reset();  // freed first: the ledger never shows memory that is still held
        state->sub(tier, kind, nbytes);
      },
      raw.options());
}

bool page_locked(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !at::globalContext().hasCUDA()) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, t.storage().data()) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

at::Tensor LedgerAlloc::host_empty(MemoryLedger& ledger, int64_t numel, at::ScalarType dtype, bool pin, Kind kind, const std::string& what) {
  if (pin) {
    try {
      return empty(ledger, numel, dtype, at::kCPU, Tier::kPinnedHost, kind, what);
    } catch (const OutOfMemoryError& e) {
      // Past the host cap, pageable memory is no way out.
      if (std::string(e.what()).find("out of memory on the host (pinned and pageable)") != std::string::npos) throw;
      log::warning_once("offload.pinned", std::string(e.what()) +
                                              "; using pageable host memory for the rest (slower copies)");
    }
  }
  return empty(ledger, numel, dtype, at::kCPU, Tier::kHost, kind, what);
}

LedgerReservation::LedgerReservation(LedgerReservation&& o) noexcept { *this = std::move(o); }
LedgerReservation& LedgerReservation::operator=(LedgerReservation&& o) noexcept {
  if (this != &o) {
    if (state_) state_->sub(tier_, kind_, nbytes_);
    state_ = std::move(o.state_);
    tier_ = o.tier_;
    kind_ = o.kind_;
    nbytes_ = o.nbytes_;
    o.nbytes_ = 0;
  }
  return *this;
}
LedgerReservation::~LedgerReservation() {
  if (state_) state_->sub(tier_, kind_, nbytes_);
}

LedgerReservation LedgerAlloc::reserve(MemoryLedger& ledger, Tier tier, Kind kind, int64_t nbytes,
                                       const std::string& what) {
  ledger.shared_->add(tier, kind, nbytes, what);
  LedgerReservation r;
  r.state_ = ledger.shared_;
  r.tier_ = tier;
  r.kind_ = kind;
  r.nbytes_ = nbytes;
  return r;
}

void MemoryLedger::set_page_locking(bool on, int cuda_device) { shared_->page_lock_device = on ? cuda_device : -1; }

void MemoryLedger::set_limit(Tier tier, int64_t nbytes, const std::string& config_key) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->limits[static_cast<int>(tier)] = nbytes > 0 ? nbytes : 0;
  shared_->limit_keys[static_cast<int>(tier)] = config_key;
}

void MemoryLedger::set_host_limit(int64_t nbytes, const std::string& config_key) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->host_limit = nbytes > 0 ? nbytes : 0;
  shared_->host_limit_key = config_key;
}

LedgerCounter MemoryLedger::get(Tier tier, Kind kind) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->cells[static_cast<int>(tier)][static_cast<int>(kind)];
}

LedgerCounter MemoryLedger::get(Tier tier) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->tiers[static_cast<int>(tier)];
}

int64_t MemoryLedger::current_bytes(Kind kind) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  int64_t sum = 0;
  for (int t = 0; t < kNumTiers; ++t) sum += shared_->cells[t][static_cast<int>(kind)].current_bytes;
  return sum;
}

void MemoryLedger::reset_peaks() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  for (auto& row : shared_->cells)
    for (auto& c : row) c.peak_bytes = c.current_bytes;
  for (auto& t : shared_->tiers) t.peak_bytes = t.current_bytes;
  shared_->host_total.peak_bytes = shared_->host_total.current_bytes;
}

LedgerCounter MemoryLedger::host_total() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->host_total;
}

std::string MemoryLedger::summary() const {
  std::ostringstream out;
  char line[160];
  std::snprintf(line, sizeof line, "%-12s %-17s %12s %12s\n", "tier", "kind", "current", "peak");
  out << line;
  std::lock_guard<std::mutex> lock(shared_->mu);
  for (int t = 0; t < kNumTiers; ++t) {
    for (int k = 0; k < kNumKinds; ++k) {
      const auto& c = shared_->cells[t][k];
      if (c.peak_bytes == 0) continue;
      std::snprintf(line, sizeof line, "%-12s %-17s %12s %12s\n", to_string(static_cast<Tier>(t)),
                    to_string(static_cast<Kind>(k)), format_bytes(c.current_bytes).c_str(),
                    format_bytes(c.peak_bytes).c_str());
      out << line;
    }
    const auto& tt = shared_->tiers[t];
    std::snprintf(line, sizeof line, "%-12s %-17s %12s %12s\n", to_string(static_cast<Tier>(t)),
                  "(tier total)", format_bytes(tt.current_bytes).c_str(),
                  format_bytes(tt.peak_bytes).c_str());
    out << line;
  }
  auto cpu = cpu_allocator_stats();
  if (cpu.installed) {
    std::snprintf(line, sizeof line, "%-12s %-17s %12s %12s\n", "cpu", "(all tensors)",
                  format_bytes(cpu.current_bytes).c_str(), format_bytes(cpu.peak_bytes).c_str());
    out << line;
  }
  return out.str();
}

// ---------------------------------------------------------------------------
// Counting CPU allocator.

namespace {

std::atomic<int64_t> g_cpu_current{0};
std::atomic<int64_t> g_cpu_peak{0};
std::atomic<int64_t> g_cpu_allocs{0};
std::atomic<bool> g_installed{false};
// NOTE [emulated device memory]
// A CPU run has no device, yet the max-parameter search and the memory tests
// need a device budget to hit. Its device memory is every CPU tensor byte
// that no ledger counts on a host tier: what a GPU run would keep in device
// memory (the states the ledger puts on the device tier, and the activations,
// gathered layers and temporaries the ledger never sees). The counting
// allocator sees every CPU tensor; a ledger's host-tier bytes are counted
// before their tensor is allocated (LedgerAlloc::empty), so at each
// allocation device = counted bytes + this allocation - host-tier bytes. A
// cap turns the allocation past it into zero::OutOfMemoryError, as the CUDA
// caching allocator's memory fraction does on a GPU.
std::atomic<int64_t> g_device_peak{0};
std::atomic<int64_t> g_device_cap{0};
std::mutex g_device_help_mu;
std::string g_device_help;  // under g_device_help_mu

// Each allocation carries a header of kHeader bytes before the data, holding
// its size, so the data pointer can be its own context (LibTorch's
// raw_allocate requires that of CPU allocations) and the free knows how many
// bytes to take off. kHeader keeps the data 64-byte aligned, as c10's own.
constexpr size_t kHeader = 64;

void update_peak(int64_t now) {
  int64_t peak = g_cpu_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_cpu_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void counted_free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t nbytes = 0;
  std::memcpy(&nbytes, base, sizeof nbytes);
  g_cpu_current.fetch_sub(nbytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const auto n = static_cast<int64_t>(nbytes);
    const int64_t device = g_cpu_current.load(std::memory_order_relaxed) + n -
                           g_host_tier_bytes.load(std::memory_order_relaxed);
    const int64_t cap = g_device_cap.load(std::memory_order_relaxed);
    if (cap > 0 && device > cap) {
      std::string help;
      {
        std::lock_guard<std::mutex> lock(g_device_help_mu);
        help = g_device_help;
      }
      throw OutOfMemoryError("out of memory on the device (a CPU run's device memory, NOTE [emulated device memory]): " +
                             format_bytes(n) + " asked, " + format_bytes(device - n) + " in use, limit " +
                             format_bytes(cap) + (help.empty() ? "" : " (" + help + ")"));
    }
    int64_t peak = g_device_peak.load(std::memory_order_relaxed);
    while (device > peak && !g_device_peak.compare_exchange_weak(peak, device, std::memory_order_relaxed)) {
    }
    char* base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeader));
    std::memcpy(base, &n, sizeof n);
    void* data = base + kHeader;
    update_peak(g_cpu_current.fetch_add(n, std::memory_order_relaxed) + n);
    g_cpu_allocs.fetch_add(1, std::memory_order_relaxed);
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void install_counting_cpu_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: tensors may be freed during static destruction.
    static auto* alloc = new CountingCpuAllocator();
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_installed = true;
  });
}

CpuAllocatorStats cpu_allocator_stats() {
  return {g_installed.load(), g_cpu_current.load(), g_cpu_peak.load(), g_cpu_allocs.load()};
}

void reset_cpu_allocator_peak() {
  g_cpu_peak.store(g_cpu_current.load());
  g_device_peak.store(g_cpu_current.load() - g_host_tier_bytes.load());
}

CpuDeviceStats cpu_device_stats() {
  return {g_cpu_current.load() - g_host_tier_bytes.load(), g_device_peak.load(), g_device_cap.load()};
}

void limit_cpu_device_memory(int64_t nbytes, const std::string& help) {
  install_counting_cpu_allocator();
  {
    std::lock_guard<std::mutex> lock(g_device_help_mu);
    g_device_help = help;
  }
  g_device_cap.store(nbytes > 0 ? nbytes : 0);
}

}  // namespace zero
