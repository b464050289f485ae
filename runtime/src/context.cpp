// NOTE [run context] in context.h.
#include "context.h"

#include <malloc.h>

#include <array>
#include <cstdlib>
#include <optional>

#include "zero/core/text.h"

#include "engine_util.h"
#include "zero/core/error.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/log.h"
#include "zero/partition/zero_optimizer.h"
#include "zero/runtime/estimate.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace zero {

// The device's memory, as the caching allocator's fraction counts it.
int64_t cuda_total_memory(const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device.index());
  size_t free_bytes = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return static_cast<int64_t>(total);
}

}  // namespace zero

namespace zero::detail {

namespace {

std::string join_or(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i == 0 ? "" : i + 1 == v.size() ? " or " : ", ") + v[i];
  return out;
}

}  // namespace

std::string memory_help(const config::Config& cfg, Tier tier) {
  const auto& z = cfg.zero;
  std::vector<std::string> keys;
  if (tier == Tier::kDevice) {
    if (z.stage < 3) keys.push_back("zero_optimization.stage 3 (partitions the parameters)");
    if (z.stage >= 1 && z.offload_optimizer.device == config::OffloadDevice::kNone)
      keys.push_back("zero_optimization.offload_optimizer.device \"cpu\"");
    const bool partial = z.stage == 3 && z.offload_optimizer.device == config::OffloadDevice::kCpu &&
                         z.offload_optimizer.ratio < 1.0;  // NOTE [partial offload]
    if (partial) keys.push_back("a larger zero_optimization.offload_optimizer.ratio (1: every state on the host)");
    if (z.stage >= 2 && z.offload_optimizer.device != config::OffloadDevice::kNone &&
        z.offload_optimizer.gradients_on_device)
      keys.push_back("zero_optimization.offload_optimizer.gradients_on_device false");
    if (z.stage == 3 && z.offload_param.device == config::OffloadDevice::kNone && !partial)
      keys.push_back("zero_optimization.offload_param.device \"cpu\"");
    keys.push_back("activation checkpointing or a smaller micro-batch (train_micro_batch_size_per_gpu)");
  } else if (tier == Tier::kHost) {
    if (z.offload_optimizer.device == config::OffloadDevice::kCpu && z.stage == 3 &&
        z.offload_param.device == config::OffloadDevice::kNone)
      keys.push_back("a smaller zero_optimization.offload_optimizer.ratio (the rest stays on the device)");
    if (z.offload_optimizer.device != config::OffloadDevice::kNone && z.stage >= 2 &&
        !z.offload_optimizer.gradients_on_device)
      keys.push_back("zero_optimization.offload_optimizer.gradients_on_device true");
    if (z.offload_optimizer.device == config::OffloadDevice::kCpu && z.offload_optimizer.ratio == 1.0)
      keys.push_back("zero_optimization.offload_optimizer.device \"nvme\"");
    if (z.offload_param.device == config::OffloadDevice::kCpu)
      keys.push_back("zero_optimization.offload_param.device \"nvme\"");
    if (z.offload_param.device == config::OffloadDevice::kNvme)
      keys.push_back("a smaller zero_optimization.offload_param.max_in_cpu or buffer_count");
    if (z.offload_optimizer.device == config::OffloadDevice::kNvme)
      keys.push_back("a smaller zero_optimization.sub_group_size or offload_optimizer.buffer_count");
    if (z.stage < 3) keys.push_back("zero_optimization.stage 3");
  } else if (tier == Tier::kNvme) {
    keys.push_back("more ranks (states are partitioned across them)");
  }
  return keys.empty() ? "" : "would help: " + join_or(keys);
}

namespace {
// The environment's budgets (NOTE [run report]) where the program set none;
// returns the names the limits are "set by" in out-of-memory messages.
std::array<std::string, 3> budgets_from_environment(InitOptions& options) {
  std::array<std::string, 3> names = {"InitOptions::device_memory_limit_bytes", "InitOptions::host_memory_limit_bytes",
                                      "InitOptions::nvme_limit_bytes"};
  const std::array<const char*, 3> vars = {"ZERO_DEVICE_MEMORY", "ZERO_HOST_MEMORY", "ZERO_NVME_BYTES"};
  const std::array<std::optional<int64_t>*, 3> slots = {&options.device_memory_limit_bytes,
                                                        &options.host_memory_limit_bytes, &options.nvme_limit_bytes};
  for (size_t i = 0; i < 3; ++i) {
    const char* v = std::getenv(vars[i]);
    if (v == nullptr || *v == '\0' || slots[i]->has_value()) continue;
    const auto n = parse_byte_size(v);
    if (!n || *n <= 0)
      throw UsageError(std::string(vars[i]) + ": expected a byte count such as 512MiB, 2GiB or 80e9; got \"" + v + "\"");
    *slots[i] = *n;
    names[i] = vars[i];
  }
  return names;
}

// NOTE [host allocator]
// glibc's malloc serves a block of M_MMAP_THRESHOLD bytes or more (128 KiB
// at first) with a mapping of its own, returned to the system when freed,
// but raises the threshold to the size of each such block freed, up to 32
// MiB: once a program's fp32 parameters are cast to bf16, or a step's
// temporaries go, blocks under 32 MiB come from the heap, and freed ones
// stay resident. Measured at stage 2 + CPU offload (minGPT 57.6M, bf16, 2
// ranks, on the CPU): the process's RSS less an empty one's was 12% (fp32
// master and states) and 18% (bf16) above the ledger's device and host
// peaks with glibc's adaptive threshold, 0.1% below them with a fixed one
// of 128 KiB, at 15-25% more step time there, where every activation is a
// host allocation too. With offload on a GPU, whose activations are not
// malloc's, the engine fixes the threshold at 128 KiB, so the host holds
// what the ledger counts; ZERO_HOST_MMAP_THRESHOLD (bytes, at most 32 MiB;
// 0: glibc's adaptive default) decides for any run.
void set_host_mmap_threshold(const config::Config& cfg, const torch::Device& device, int64_t rank) {
  const auto& z = cfg.zero;
  const bool offload = z.stage > 0 && (z.offload_optimizer.device != config::OffloadDevice::kNone ||
                                       z.offload_param.device != config::OffloadDevice::kNone);
  int64_t bytes = offload && device.is_cuda() ? int64_t{128} << 10 : 0;
  const char* v = std::getenv("ZERO_HOST_MMAP_THRESHOLD");
  if (v != nullptr && *v != '\0') {
    const auto n = std::string(v) == "0" ? std::optional<int64_t>(0) : parse_byte_size(v);
    if (!n || *n > (int64_t{32} << 20))
      throw UsageError(std::string("ZERO_HOST_MMAP_THRESHOLD: expected a byte count up to 32MiB such as 128KiB, or 0 "
                                   "for glibc's adaptive threshold; got \"") + v + "\"");
    bytes = *n;
  }
  if (bytes == 0) return;
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1) {
    log::warning("could not set malloc's M_MMAP_THRESHOLD to " + std::to_string(bytes) + " bytes");
    return;
  }
  if (rank == 0)
    log::info("host allocations of " + format_bytes(bytes) + " or more get their own mappings, returned when freed "
              "(malloc's M_MMAP_THRESHOLD fixed, NOTE [host allocator]; ZERO_HOST_MMAP_THRESHOLD=0 keeps glibc's "
              "adaptive threshold)");
}

}  // namespace

void apply_memory_budgets(const config::Config& cfg, const InitOptions& options, const torch::Device& device,
                          MemoryLedger& ledger, const std::array<std::string, 3>& names) {
  if (auto cap = options.device_memory_limit_bytes) {
    ZERO_CHECK(*cap > 0, "InitOptions::device_memory_limit_bytes must be positive");
    const std::string help = "set by " + names[0] + "; " + memory_help(cfg, Tier::kDevice);
    if (device.is_cuda()) {
      // The caching allocator exists only once CUDA is initialised; a program
      // whose first CUDA tensor comes after the engine (mingpt under zero::Init,
      // --find-max-params's probes on the card) got "Allocator not initialized
      // for device".
      at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
      const int64_t total = zero::cuda_total_memory(device);
      if (*cap < total)
        c10::cuda::CUDACachingAllocator::setMemoryFraction(static_cast<double>(*cap) / static_cast<double>(total),
                                                           device.index());
    } else {
      limit_cpu_device_memory(*cap, help);
    }
  } else if (device.is_cpu()) {
    // The cap is process-wide: an earlier engine's budget does not outlive it
    // into one built without a budget.
    limit_cpu_device_memory(0, "");
  }
  if (auto cap = options.host_memory_limit_bytes) {
    ZERO_CHECK(*cap > 0, "InitOptions::host_memory_limit_bytes must be positive");
    ledger.set_host_limit(*cap, names[1] + "; " + memory_help(cfg, Tier::kHost));
  }
  if (auto cap = options.nvme_limit_bytes) {
    ZERO_CHECK(*cap > 0, "InitOptions::nvme_limit_bytes must be positive");
    ledger.set_limit(Tier::kNvme, *cap, names[2] + "; " + memory_help(cfg, Tier::kNvme));
  }
}

RunContext make_context(config::Config config, InitOptions options) {
  RunContext c;
  c.config = std::move(config);
  c.dist = options.dist ? *options.dist : DistEnv::from_environment();
  options.dist = c.dist;
  if (c.config.world_size != c.dist.world_size) {
    throw ConfigError({c.config.source + ": the batch sizes were resolved for world size " +
                       std::to_string(c.config.world_size) + " but this job has " +
                       std::to_string(c.dist.world_size) + " ranks"});
  }
  c.device = resolve_device(options.device, c.dist);
  c.dtype = partition::compute_dtype(c.config);
  c.grad_accum_dtype = partition::grad_accum_dtype(c.config);
  if (c.device.is_cpu()) install_counting_cpu_allocator();
  // A CPU run on a machine with a GPU pins nothing.
  c.ledger->set_page_locking(c.device.is_cuda(), c.device.is_cuda() && c.device.has_index() ? c.device.index() : 0);
  c.ledger->set_limit(Tier::kPinnedHost, options.pinned_memory_limit_bytes.value_or(default_pinned_limit(c.dist.local_world_size)),
                      "InitOptions::pinned_memory_limit_bytes");
  const auto names = budgets_from_environment(options);
  apply_memory_budgets(c.config, options, c.device, *c.ledger, names);
  set_host_mmap_threshold(c.config, c.device, c.dist.rank);
  c.options = std::move(options);
  return c;
}

}  // namespace zero::detail
