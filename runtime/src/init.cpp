#include "zero/core/ledger_alloc.h"
#include "zero/runtime/init.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

#include "engine_util.h"
#include "init_state.h"
#include "zero/offload/swap_folder.h"
#include "zero/core/error.h"
#include "zero/partition/flat_parameters.h"
#include "zero/partition/zero_optimizer.h"

namespace zero {

namespace {

void release_parameters(InitState& s, const InitState::Layer& layer) {
  at::NoGradGuard no_grad;
  for (const auto& p : layer.params) {
    p.set_data(at::empty({0}, p.options()));  // the whole parameter is freed here
    s.partitioned.insert(p.unsafeGetTensorImpl());
  }
}

// Writes this rank's chunk (elements [begin, begin + numel) of `values` laid
// end to end) at the end of the parameter swap file, made on the first call;
// returns its offset. The chunk passes through an aligned host buffer, held
// (and counted on the host tier) while it is written; the write goes on while
// the next layer is built, so at most two such buffers exist at once.
int64_t swap_out(InitState& s, const std::vector<at::Tensor>& values, int64_t begin, int64_t numel) {
  const auto& op = s.config.zero.offload_param;
  const std::string key = "zero_optimization.offload_param";
  const std::string tag = "rank" + std::to_string(s.dist.rank) + "-params";
  if (s.swap_file == nullptr) {
    s.aio = std::make_unique<offload::AioEngine>(detail::aio_options(s.config.aio));
    s.swap_file = offload::create_swap_files(op.nvme_path, key + ".nvme_path", tag,
                                             "stage-3 shards of " + tag + " built under zero::Init",
                                             {{"params.swp", 0}})
                      .front();
  }
  if (numel > op.buffer_size) {  // the engine's swapper would refuse it; say so before writing the model
    throw ConfigError({key + ".buffer_size: expected at least " + std::to_string(numel) +
                       " elements, this rank's shard of a layer built under zero::Init; got " +
                       std::to_string(op.buffer_size)});
  }
  const int64_t bytes = offload::aio_aligned(numel * static_cast<int64_t>(c10::elementSize(s.dtype)));
  const int64_t offset = s.swap_bytes;
  try {
    s.swap_file->reserve(offset + bytes);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (while zero::Init wrote layer shards under " + key +
                  ".nvme_path; free space there, or keep more in memory with " + key + ".max_in_cpu)");
  }
  InitState::PendingWrite next;
  next.held = LedgerAlloc::reserve(*s.ledger, Tier::kHost, Kind::kParameters, bytes, "a shard on its way to disk under zero::Init");
  next.buf = offload::AlignedBuffer(bytes);
  std::memset(next.buf.data(), 0, static_cast<size_t>(bytes));  // the file's padding too
  at::Tensor chunk = at::from_blob(next.buf.data(), {numel}, at::TensorOptions().dtype(s.dtype));
  partition::copy_chunk_of(values, begin, chunk);
  s.finish_swap_out();  // the previous layer's
  next.io = s.aio->write(s.swap_file, next.buf.data(), bytes, offset);
  s.pending = std::move(next);
  s.swap_bytes = offset + bytes;
  s.swap_disk = {};
  s.swap_disk = LedgerAlloc::reserve(*s.ledger, Tier::kNvme, Kind::kParameters, s.swap_bytes, "parameter swap file (zero::Init)");
  return offset;
}

}  // namespace

Init::Init(const std::string& config, InitOptions options) : state_(std::make_shared<InitState>()) {
  auto& s = *state_;
  if (!options.dist) options.dist = DistEnv::from_environment();
  s.dist = *options.dist;
  s.config = detail::load_config(config, options);
  if (s.config.zero.stage != 3) {
    throw ConfigError({s.config.source + ": zero_optimization.stage: expected 3 for zero::Init (partitioned "
                       "construction); got " + std::to_string(s.config.zero.stage)});
  }
  s.device = detail::resolve_device(options.device, s.dist);
  s.dtype = partition::compute_dtype(s.config);
  if (s.device.is_cpu()) install_counting_cpu_allocator();
  s.ledger->set_limit(Tier::kPinnedHost, options.pinned_memory_limit_bytes.value_or(detail::default_pinned_limit()),
                      "InitOptions::pinned_memory_limit_bytes");
  s.options = std::move(options);
  s.in_cpu_left = std::max<int64_t>(0, s.config.zero.offload_param.max_in_cpu);
}

Init::~Init() = default;

MemoryLedger& Init::ledger() { return *state_->ledger; }
const config::Config& Init::config() const { return state_->config; }
const InitOptions& Init::options() const { return state_->options; }

// Lays the layer's parameters out as the engine's stage-3 group (NOTE [flat
// layout]), keeps this rank's chunk and empties the parameters.
void Init::partition_module(const std::shared_ptr<torch::nn::Module>& module) {
  auto& s = *state_;
  ZERO_CHECK(module != nullptr, "Init::partition: no module");
  ZERO_CHECK(!s.adopted, "Init::partition after initialize: the engine has taken over");
  if (s.layers.count(module.get()) > 0) return;
  InitState::Layer layer;
  layer.module = module;
  int64_t numel = 0;
  for (const auto& p : module->parameters(true)) {
    if (!p.requires_grad() || p.numel() < s.config.zero.param_persistence_threshold) continue;
    if (s.partitioned.count(p.unsafeGetTensorImpl()) > 0) continue;  // tied to an earlier layer
    if (std::find_if(layer.params.begin(), layer.params.end(), [&](const at::Tensor& q) {
          return q.is_same(p);
        }) != layer.params.end())
      continue;  // used twice in this layer
    layer.params.push_back(p);
    layer.shapes.push_back(p.sizes().vec());
    numel += p.numel();
  }
  if (layer.params.empty()) return;
  const int64_t ws = s.dist.world_size;
  const int64_t padded = partition::FlatParameters::padded_size(numel, ws);
  const int64_t chunk_numel = padded / ws;
  const int64_t begin = s.dist.rank * chunk_numel;
  std::vector<at::Tensor> values;
  for (const auto& p : layer.params) values.push_back(p.detach());
  // offload_param nvme: shards within max_in_cpu stay in host memory, in the
  // order the layers are built (as the engine's swapper decides for layers
  // built whole); the others go to disk now, so host memory never holds more
  // than one of them.
  const bool nvme = s.config.zero.offload_param.device == config::OffloadDevice::kNvme;
  if (nvme && chunk_numel > s.in_cpu_left) {
    layer.disk_offset = swap_out(s, values, begin, chunk_numel);
    release_parameters(s, layer);
    s.layers.emplace(module.get(), std::move(layer));
    return;
  }
  if (nvme) s.in_cpu_left -= chunk_numel;
  // offload_param cpu or nvme: the shard in host memory.
  const bool offload = s.config.zero.offload_param.device != config::OffloadDevice::kNone;
  const std::string what = "stage-3 shard of a layer built under zero::Init";
  layer.chunk = offload ? LedgerAlloc::host_empty(*s.ledger, chunk_numel, s.dtype, s.config.zero.offload_param.pin_memory,
                                               Kind::kParameters, what)
                        : LedgerAlloc::empty(*s.ledger, chunk_numel, s.dtype, s.device, Tier::kDevice, Kind::kParameters, what);
  partition::copy_chunk_of(values, begin, layer.chunk);
  release_parameters(s, layer);
  s.layers.emplace(module.get(), std::move(layer));
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& layers) {
  if (init.state_->adopted) throw UsageError("zero::initialize: this zero::Init was already given to an engine");
  InitOptions options = init.options();
  options.layers.insert(options.layers.end(), layers.begin(), layers.end());
  return Engine(std::move(model), init.config(), std::move(options), init.state_);
}

}  // namespace zero
