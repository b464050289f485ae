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

void release_parameters(InitState& s, const partition::PrebuiltGroup& group) {
  at::NoGradGuard no_grad;
  for (const auto& p : group.params) {
    p.set_data(at::empty({0}, p.options()));  // the whole parameter is freed here
    s.built.partitioned.insert(p.unsafeGetTensorImpl());
  }
}

// Writes this rank's chunk (elements [begin, begin + numel) of `values` laid
// end to end) at the end of the parameter swap file, made on the first call;
// returns its offset. The chunk passes through an aligned host buffer, held
// (and counted on the host tier) while it is written; the write goes on while
// the next layer is built, so at most two such buffers exist at once.
int64_t swap_out(InitState& s, const std::vector<at::Tensor>& values, int64_t begin, int64_t numel, Kind kind) {
  const auto& op = s.ctx.config.zero.offload_param;
  const std::string key = "zero_optimization.offload_param";
  const std::string tag = "rank" + std::to_string(s.ctx.dist.rank) + "-params";
  if (s.built.swap_file == nullptr) {
    s.aio = std::make_unique<offload::AioEngine>(partition::aio_options(s.ctx.config.aio));
    s.built.swap_file = offload::create_swap_files(op.nvme_path, key + ".nvme_path", tag,
                                             "stage-3 shards of " + tag + " built under zero::Init",
                                             {{"params.swp", 0}})
                      .front();
  }
  if (numel > op.buffer_size) {  // the engine's swapper would refuse it; say so before writing the model
    throw ConfigError({key + ".buffer_size: expected at least " + std::to_string(numel) +
                       " elements, this rank's shard of a layer built under zero::Init; got " +
                       std::to_string(op.buffer_size)});
  }
  const int64_t bytes = offload::aio_aligned(numel * static_cast<int64_t>(c10::elementSize(s.ctx.dtype)));
  const int64_t offset = s.built.swap_bytes;
  try {
    s.built.swap_file->reserve(offset + bytes);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (while zero::Init wrote layer shards under " + key +
                  ".nvme_path; free space there, or keep more in memory with " + key + ".max_in_cpu)");
  }
  InitState::PendingWrite next;
  next.held = LedgerAlloc::reserve(*s.ctx.ledger, Tier::kHost, kind, bytes, "a shard on its way to disk under zero::Init");
  next.buf = offload::AlignedBuffer(bytes);
  std::memset(next.buf.data(), 0, static_cast<size_t>(bytes));  // the file's padding too
  at::Tensor chunk = at::from_blob(next.buf.data(), {numel}, at::TensorOptions().dtype(s.ctx.dtype));
  partition::copy_chunk_of(values, begin, chunk);
  s.finish_swap_out();  // the previous layer's
  next.io = s.aio->write(s.built.swap_file, next.buf.data(), bytes, offset);
  s.pending = std::move(next);
  s.built.swap_bytes = offset + bytes;
  s.swap_disk = {};
  s.swap_disk = LedgerAlloc::reserve(*s.ctx.ledger, Tier::kNvme, Kind::kParameters, s.built.swap_bytes,
                                     "parameter swap file (zero::Init)");
  return offset;
}

}  // namespace

Init::Init(const std::string& config, InitOptions options) : state_(std::make_shared<InitState>()) {
  auto& s = *state_;
  if (!options.dist) options.dist = DistEnv::from_environment();
  auto cfg = detail::load_config(config, options);
  // initialize(model, init) prints none again.
  detail::print_config_warnings(cfg, *options.dist, options.auto_value_flags);
  if (cfg.zero.stage != 3) {
    throw ConfigError({cfg.source + ": zero_optimization.stage: expected 3 for zero::Init (partitioned "
                       "construction); got " + std::to_string(cfg.zero.stage)});
  }
  s.ctx = detail::make_context(std::move(cfg), std::move(options));
  const auto& z = s.ctx.config.zero;
  s.built.persistence = partition::PersistenceRule(z.param_persistence_threshold, z.model_persistence_threshold);
  s.built.in_cpu = partition::InCpuBudget(z.offload_param.max_in_cpu);
  s.built.finish_writes = [st = state_.get()] { st->finish_swap_out(); };
}

Init::~Init() = default;

MemoryLedger& Init::ledger() { return *state_->ctx.ledger; }
const config::Config& Init::config() const { return state_->ctx.config; }
const InitOptions& Init::options() const { return state_->ctx.options; }

// Lays the layer's parameters out as the engine's stage-3 groups (NOTE
// [flat layout]; the trainable ones, then the frozen ones: NOTE [frozen
// groups]), keeps this rank's chunk of each and empties the parameters.
void Init::partition_module(const std::shared_ptr<torch::nn::Module>& module, const std::string& name) {
  auto& s = *state_;
  ZERO_CHECK(module != nullptr, "Init::partition: no module");
  if (s.adopted) throw UsageError("zero::Init::partition after zero::initialize took this Init");
  if (s.built.layers.count(module.get()) > 0) return;
  partition::PrebuiltLayer layer;
  layer.module = module;
  int64_t numel[2] = {0, 0};
  for (const auto& item : module->named_parameters(true)) {
    const auto& p = item.value();
    const void* id = p.unsafeGetTensorImpl();
    if (s.built.partitioned.count(id) > 0 || s.built.kept_whole.count(id) > 0) continue;  // tied to an earlier layer
    auto used = [&](const partition::PrebuiltGroup& g) {
      return std::find_if(g.params.begin(), g.params.end(), [&](const at::Tensor& q) { return q.is_same(p); }) !=
             g.params.end();
    };
    if (used(layer.trainable) || used(layer.frozen)) continue;  // used twice in this layer
    // InitOptions::trainable decides as the layer is built (NOTE [frozen groups]).
    if (s.ctx.options.trainable) p.requires_grad_(s.ctx.options.trainable(name.empty() ? item.key() : name + "." + item.key()));
    const bool frozen = !p.requires_grad();
    // NOTE [stage-3 plan]: the plan's persistence rule, applied as the layer is built.
    if (s.built.persistence.keep_whole(p.numel())) {
      s.built.kept_whole.insert(id);
      continue;
    }
    auto& g = frozen ? layer.frozen : layer.trainable;
    g.params.push_back(p);
    g.shapes.push_back(p.sizes().vec());
    numel[frozen] += p.numel();
  }
  if (layer.trainable.empty() && layer.frozen.empty()) return;
  // NOTE [MiCS]: partitioned across the rank's shard group.
  const int64_t ws = config::partition_ranks(s.ctx.config);
  const auto& op = s.ctx.config.zero.offload_param;
  const bool nvme = op.device == config::OffloadDevice::kNvme;
  const bool offload = op.device != config::OffloadDevice::kNone;
  for (const bool frozen : {false, true}) {
    auto& g = frozen ? layer.frozen : layer.trainable;
    if (g.empty()) continue;
    const Kind kind = frozen ? Kind::kFrozenParameters : Kind::kParameters;
    const int64_t padded = partition::FlatParameters::padded_size(numel[frozen], ws);
    const int64_t chunk_numel = padded / ws;
    const int64_t begin = s.ctx.dist.rank % ws * chunk_numel;
    std::vector<at::Tensor> values;
    for (const auto& p : g.params) values.push_back(p.detach());
    // offload_param nvme: shards within max_in_cpu stay in host memory, in the
    // order the layers are built (the plan's rule); the others go to disk now,
    // so host memory never holds more than one of them.
    if (nvme && !s.built.in_cpu.keep(chunk_numel)) {
      g.disk_offset = swap_out(s, values, begin, chunk_numel, kind);
    } else {
      // offload_param cpu or nvme: the shard in host memory.
      const std::string what = std::string("stage-3 ") + (frozen ? "frozen " : "") + "shard of a layer built under zero::Init";
      g.chunk = offload ? LedgerAlloc::host_empty(*s.ctx.ledger, chunk_numel, s.ctx.dtype, op.pin_memory, kind, what)
                        : LedgerAlloc::empty(*s.ctx.ledger, chunk_numel, s.ctx.dtype, s.ctx.device, Tier::kDevice, kind, what);
      partition::copy_chunk_of(values, begin, g.chunk);
    }
  }
  // Both shards made: only now are the parameters emptied (a failure above
  // leaves the module whole).
  release_parameters(s, layer.trainable);
  release_parameters(s, layer.frozen);
  s.built.layers.emplace(module.get(), std::move(layer));
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, Init& init,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& layers, torch::optim::Optimizer* optimizer) {
  if (init.state_->adopted) throw UsageError("zero::initialize: this zero::Init was already given to an engine");
  InitOptions options = init.options();
  options.layers.insert(options.layers.end(), layers.begin(), layers.end());
  if (optimizer != nullptr) options.optimizer = optimizer;
  return Engine(std::move(model), init.config(), std::move(options), init.state_);
}

}  // namespace zero
