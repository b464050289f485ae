#include "zero/runtime/init.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "engine_util.h"
#include "init_state.h"
#include "zero/runtime/error.h"
#include "zero/runtime/log.h"
#include "zero/zero/flat_parameters.h"
#include "zero/zero/zero_optimizer.h"

namespace zero {

Init::Init(const std::string& config, InitOptions options) : state_(std::make_shared<State>()) {
  auto& s = *state_;
  if (!options.dist) options.dist = DistEnv::from_environment();
  s.dist = *options.dist;
  s.config = detail::load_config(config, options);
  if (s.config.zero.stage != 3) {
    throw ConfigError({s.config.source + ": zero_optimization.stage: expected 3 for zero::Init (partitioned "
                       "construction); got " + std::to_string(s.config.zero.stage)});
  }
  s.device = options.device ? *options.device : detail::default_device();
  s.dtype = partition::compute_dtype(s.config);
  if (s.device.is_cpu()) install_counting_cpu_allocator();
  s.ledger->set_limit(Tier::kPinnedHost, options.pinned_memory_limit_bytes.value_or(detail::default_pinned_limit()),
                      "InitOptions::pinned_memory_limit_bytes");
  s.options = std::move(options);
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
  State::Layer layer;
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
  // offload_param cpu or nvme: the shards start in host memory (nvme: the
  // engine moves those beyond max_in_cpu to disk).
  const bool offload = s.config.zero.offload_param.device != config::OffloadDevice::kNone;
  const Tier tier = !offload ? Tier::kDevice : s.config.zero.offload_param.pin_memory ? Tier::kPinnedHost : Tier::kHost;
  const std::string what = "stage-3 shard of a layer built under zero::Init";
  const at::Device where = offload ? at::Device(at::kCPU) : s.device;
  try {
    layer.chunk = s.ledger->empty(chunk_numel, s.dtype, where, tier, Kind::kParameters, what);
  } catch (const OutOfMemoryError& e) {
    if (tier != Tier::kPinnedHost) throw;
    log::warning_once("offload.pinned", std::string(e.what()) + "; using pageable host memory for the rest");
    layer.chunk = s.ledger->empty(chunk_numel, s.dtype, where, Tier::kHost, Kind::kParameters, what);
  }
  std::vector<at::Tensor> values;
  for (const auto& p : layer.params) values.push_back(p.detach());
  partition::copy_chunk_of(values, begin, layer.chunk);
  at::NoGradGuard no_grad;
  for (auto& p : layer.params) {
    p.set_data(at::empty({0}, p.options()));  // the whole parameter is freed here
    s.partitioned.insert(p.unsafeGetTensorImpl());
  }
  s.layers.emplace(module.get(), std::move(layer));
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init) {
  InitOptions options = init.options();
  options.init = &init;
  return initialize(std::move(model), init.config(), std::move(options));
}

}  // namespace zero
