#include "zero/core/text.h"
#include "zero/core/ledger_alloc.h"
#include "zero/runtime/engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <unordered_map>
#include <unordered_set>

#include "zero/optim/flat_optimizer.h"
#include "zero/optim/loss_scaler.h"
#include "zero/optim/lr_scheduler.h"
#include "zero/core/error.h"
#include "zero/core/log.h"
#include "zero/core/command_files.h"
#include "zero/core/trace.h"
#include "engine_util.h"
#include "run_reporter.h"
#include "zero/runtime/engine_internal.h"
#include "zero/snapshots/checkpoint_format.h"
#include "context.h"
#include "engine_impl.h"
#include "init_state.h"
#include "zero/partition/stage3_plan.h"
#include "zero/partition/layer.h"
#include <c10/util/accumulate.h>
#include "zero/partition/zero_optimizer.h"

namespace zero {
namespace {

// Moves every parameter and buffer to `device`, floating ones to `dtype`
// (integer buffers such as token ids keep their type).
void cast_module(torch::nn::Module& module, torch::Device device, torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  auto cast = [&](torch::Tensor& t) {
    if (!t.defined()) return;
    auto target = t.is_floating_point() ? dtype : t.scalar_type();
    if (t.device() != device || t.scalar_type() != target) t.set_data(t.to(device, target));
  };
  for (auto& p : module.parameters()) cast(p);
  for (auto& b : module.buffers()) cast(b);
}

// InitOptions::param_groups onto the optimizer's slots: each parameter in
// the first group that matches it, else the default group; said on rank 0.
void apply_param_groups(Engine::Impl& s) {
  const auto& groups = s.options.param_groups;
  std::vector<partition::ZeroOptimizer::GroupHyper> hypers{{"default", std::nullopt, std::nullopt}};
  std::set<std::string> names{"default"};
  for (const auto& g : groups) {
    if (g.name.empty() || !names.insert(g.name).second)
      throw ConfigError({"InitOptions::param_groups: group names must be unique and not empty (\"default\" is the "
                         "config's group); got \"" + g.name + "\""});
    if (!g.match) throw ConfigError({"InitOptions::param_groups: group " + g.name + " has no match function"});
    if ((g.weight_decay && !(*g.weight_decay >= 0)) || (g.lr && !(*g.lr >= 0)))
      throw ConfigError({"InitOptions::param_groups: group " + g.name + ": expected lr and weight_decay >= 0"});
    hypers.push_back({g.name, g.lr, g.weight_decay});
  }
  const auto& slots = s.optimizer->parameters().slots();
  std::vector<size_t> group_of(slots.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i)
    for (size_t k = 0; k < groups.size(); ++k)
      if (groups[k].match(slots[i].name, slots[i].param)) {
        group_of[i] = k + 1;
        break;
      }
  s.optimizer->set_param_groups(hypers, group_of);
  if (s.dist.rank != 0) return;
  const auto numels = s.optimizer->param_group_numels();
  std::string line = "parameter groups:";
  for (size_t k = 0; k < hypers.size(); ++k) {
    const auto& h = hypers[k];
    std::ostringstream o;
    o << " " << h.name << " " << numels[k] << " parameters (weight_decay "
      << h.weight_decay.value_or(s.config.optimizer->weight_decay) << ", lr " << h.lr.value_or(s.config.optimizer->lr)
      << ")" << (k + 1 < hypers.size() ? ";" : "");
    line += o.str();
    if (k > 0 && numels[k] == 0) log::warning("parameter group " + h.name + " matches no parameter of the model");
  }
  log::info(line);
}

// NOTE [user backward]
// A backward the program starts itself (loss.backward(), out.backward(grad),
// a loss that spans several engines) reaches the engine through the
// gradient hooks: the first gradient that arrives outside Engine::backward
// begins the engine's backward there (the reducer's and, at stage 3, the
// coordinator's bookkeeping, as Engine::backward does before autograd runs)
// and asks for a callback that ends it when autograd's pass is over (the
// outermost pass: a checkpoint's recompute runs a nested one,
// checkpointing::queue_when_backward_ends). The loss of such a backward
// was multiplied by a factor the step divides by: 1 for a plain
// loss.backward(); the fp16 loss scale when the program asked
// engine.scale(loss) for it (DeepSpeed's rule for manual backward); another
// engine's scale / gas when that engine's Engine::backward feeds this one's
// parameters too. Every engine reads the factor of the pass in progress
// (one process-wide value: hooks run on autograd's device threads, not the
// program's). The step divides by the factor times gas, so the bits equal
// Engine::backward's (the factors are powers of two when gas is). One
// backward per micro-step, one factor per accumulation window. A backward
// that fails before its end leaves the engine begun: the next step() or
// Engine::backward finds it so, discards its gradients and says so.
std::mutex g_factor_mutex;
double g_pass_factor = 0;  // the factor of the backward pass in progress (0: none set)
double g_next_factor = 0;  // engine.scale(): the factor of the next pass

// NOTE [trace]: ZERO_TRACE=FILE, checked as every output is (NOTE [outputs
// and inputs]) before the run starts.
void start_trace(Engine::Impl& s) {
  const char* value = std::getenv("ZERO_TRACE");
  if (value == nullptr || *value == '\0') return;
  const std::string path = trace::trace_path_for_rank(value, s.dist.rank, s.dist.world_size);
  if (const std::string problem = ckpt::output_file_problem("ZERO_TRACE", path); !problem.empty())
    throw UsageError(problem);
  trace::start(path, s.dist.rank, s.dist.world_size);
  if (s.dist.rank != 0) return;
  std::string where = path;
  if (s.dist.world_size > 1) {  // FILE.rank0.json: say FILE.rankR.json
    where = trace::trace_path_for_rank(value, 0, s.dist.world_size);
    where.replace(where.rfind(".rank0"), 6, ".rankR");
    where += " for rank R (`zero trace merge` joins them)";
  }
  log::info("ZERO_TRACE: a Chrome trace of each rank's steps goes to " + where +
            ", written when the engine ends; open it in https://ui.perfetto.dev or chrome://tracing");
}

// Thrown when a backward the program started ended in an error: its
// gradients, partly reduced, are discarded.
void recover_from_failed_backward(Engine::Impl& s) {
  if (!s.user_backward_open) return;
  s.user_backward_open = false;
  s.window_backward = Engine::Impl::Backward::kNone;
  s.backward_micro_step = -1;  // the micro-step runs again
  {
    std::lock_guard<std::mutex> lock(g_factor_mutex);
    g_pass_factor = 0;  // the failed pass never cleared it
  }
  s.optimizer->abandon_backward();
  throw UsageError("the last backward the program started (loss.backward()) ended in an error before it finished; "
                   "the gradients of this accumulation window are discarded: run its micro-steps again");
}

void begin_user_backward(Engine::Impl& s) {
  using B = Engine::Impl::Backward;
  double factor = 1.0;
  bool owner = false;  // this engine set the pass's factor and clears it at the end
  {
    std::lock_guard<std::mutex> lock(g_factor_mutex);
    if (g_pass_factor == 0) {
      g_pass_factor = g_next_factor != 0 ? g_next_factor : 1.0;
      g_next_factor = 0;
      owner = true;
    }
    factor = g_pass_factor;
  }
  if (s.window_backward == B::kEngine)
    throw UsageError("a backward started by the program (loss.backward()) in an accumulation window whose earlier "
                     "micro-steps ran engine.backward(loss): one way per window (they scale gradients differently)");
  if (s.backward_micro_step == s.micro_steps)
    throw UsageError("a second backward in one micro-step: call engine.step() after each backward (one loss per "
                     "micro-step; sum the losses first to backpropagate several)");
  if (s.window_backward == B::kUser && s.window_factor != factor)
    throw UsageError("backwards whose losses were scaled differently (engine.scale(loss), another engine's backward, "
                     "a plain loss.backward()) in one accumulation window: keep to one");
  s.window_backward = B::kUser;
  s.window_factor = factor;
  s.backward_micro_step = s.micro_steps;
  s.optimizer->begin_backward((s.micro_steps + 1) % s.gas() == 0);
  s.user_backward_open = true;
  checkpointing::queue_when_backward_ends([&s, owner] {
    if (owner) {
      std::lock_guard<std::mutex> lock(g_factor_mutex);
      g_pass_factor = 0;
    }
    s.user_backward_open = false;
    s.optimizer->end_backward();
    s.checkpointer->end_micro_step();
  });
}

void check_trainable(const config::Config& c) {
  if (!c.optimizer) {
    throw ConfigError({c.source + ": optimizer: the config has no optimizer section and the program passed no "
                       "optimizer of its own: give the config one, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": "
                       "0.001}}, or pass a torch::optim Adam, AdamW or Adagrad as InitOptions::optimizer (NOTE [client "
                       "optimizer]; mingpt and llama: --optimizer)"});
  }
}

// One line per parameter and buffer ("name [shape] dtype", the whole shape of
// a parameter partitioned under zero::Init) and per stage-3 layer: what every
// rank must agree on, compared at initialize.
std::string model_fingerprint(const torch::nn::Module& model, const InitState* init,
                              const std::vector<std::shared_ptr<torch::nn::Module>>& layers) {
  std::unordered_map<const void*, std::vector<int64_t>> whole;
  if (init != nullptr) {
    for (const auto& [module, layer] : init->built.layers)
      for (const auto* g : {&layer.trainable, &layer.frozen})
        for (size_t i = 0; i < g->params.size(); ++i) whole[g->params[i].unsafeGetTensorImpl()] = g->shapes[i];
  }
  std::ostringstream out;
  auto shape = [&](const std::vector<int64_t>& sizes) {
    out << '[';
    for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
    out << ']';
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    out << "parameter " << item.key() << ' ';
    auto it = whole.find(p.unsafeGetTensorImpl());
    shape(it != whole.end() ? it->second : p.sizes().vec());
    out << ' ' << p.scalar_type() << (p.requires_grad() ? "" : " frozen") << '\n';
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    out << "buffer " << item.key() << ' ';
    shape(item.value().sizes().vec());
    out << ' ' << item.value().scalar_type() << '\n';
  }
  out << layers.size() << " stage-3 layers\n";
  for (const auto& layer : layers) {
    int64_t n = 0;
    for (const auto& p : layer->parameters(/*recurse=*/true)) {
      auto it = whole.find(p.unsafeGetTensorImpl());
      int64_t numel = 1;
      if (it != whole.end()) for (int64_t d : it->second) numel *= d;
      else numel = p.numel();
      n += numel;
    }
    out << "layer " << layer->name() << " of " << n << " elements\n";
  }
  return out.str();
}

// NOTE [frozen groups]: which parameters train is fixed at initialize (the
// layout, the gradients, the states follow from it). A change after it
// would train nothing, or no longer freeze: refused, naming the parameter.
void check_trainable_unchanged(const Engine::Impl& s) {
  if (s.gathered_scopes > 0)
    throw UsageError("backward or step inside a zero::GatheredParameters scope: its parameters are held gathered "
                     "(and a modifier's values would be written over the step's); end the scope first (done(), or "
                     "its destructor)");
  const auto& flat = s.optimizer->parameters();
  auto refuse = [](const std::string& name, bool now_trainable) {
    throw UsageError(
        "parameter " + name + (now_trainable ? " was set trainable (requires_grad true) after zero::initialize; it "
                                               "was frozen then, so it has no gradient, master or optimizer state"
                                             : " was frozen (requires_grad false) after zero::initialize; it was "
                                               "trainable then, and its gradient, master and optimizer state are "
                                               "laid out") +
        ": say which parameters train before initialize (requires_grad_ on the model, or InitOptions::trainable "
        "with zero::trainable_matching / frozen_matching; under zero::Init, in the Init's options)");
  };
  for (const auto& g : flat.all_groups())
    for (size_t i : g.slots)
      if (flat.all_slots()[i].param.requires_grad() == g.frozen) refuse(flat.all_slots()[i].name, g.frozen);
  for (const auto& [name, p] : s.frozen_whole)
    if (p.requires_grad()) refuse(name, true);
}

}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, config::Config config, InitOptions options)
    : Engine(std::move(model), std::move(config), std::move(options), nullptr) {}

Engine::Engine(std::shared_ptr<torch::nn::Module> model, config::Config config, InitOptions options,
               std::shared_ptr<InitState> init_state)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  ZERO_CHECK(model != nullptr, "initialize needs a model");
  if (options.trainable) {  // NOTE [frozen groups]: what Init partitioned, Init decided
    for (const auto& item : model->named_parameters(/*recurse=*/true)) {
      const void* id = item.value().unsafeGetTensorImpl();
      if (init_state != nullptr &&
          (init_state->built.partitioned.count(id) > 0 || init_state->built.kept_whole.count(id) > 0))
        continue;
      item.value().requires_grad_(options.trainable(item.key()));
    }
  }
  detail::apply_client_optimizer(config, options, *model);
  check_trainable(config);
  (void)RunReportSettings::from_environment();  // a bad ZERO_STOP_AFTER_STEPS is refused before anything is made
  InitState* init = init_state.get();
  if (init != nullptr) {
    ZERO_CHECK(!init->adopted, "this zero::Init was already given to an engine");
    init->adopted = true;
    // The Init's context (its ledger counts the shards built under it), with
    // the options initialize() completed.
    static_cast<detail::RunContext&>(s) = init->ctx;
    s.config = std::move(config);
    s.options = std::move(options);
    s.options.dist = s.dist;
  } else {
    static_cast<detail::RunContext&>(s) = detail::make_context(std::move(config), std::move(options));
  }
  s.model = std::move(model);
  if (s.dist.distributed()) {
    s.comm = Comm::connect(s.dist, s.device);
    s.comm->check_same("DeepSpeed config (" + s.config.source + " as resolved)",
                       std::to_string(std::hash<std::string>{}(s.config.canonical_json)));
    // Before any collective whose sizes come from the model: ranks built with
    // different models would otherwise fail inside Gloo or NCCL, or hang.
    const std::string model_text = model_fingerprint(*s.model, init, s.options.layers);
    s.comm->check_same("model (its parameters, buffers and stage-3 layers)",
                       std::to_string(std::hash<std::string>{}(model_text)), model_text);
  }

  cast_module(*s.model, s.device, s.dtype);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : s.model->named_parameters(/*recurse=*/true))
    named.emplace_back(item.key(), item.value());

  partition::ZeroOptimizerOptions zo;
  zo.stage = s.config.zero.stage;
  zo.bucket_numel = s.config.zero.stage == 0
                        ? s.config.zero.reduce_bucket_size
                        : std::min(s.config.zero.reduce_bucket_size, s.config.zero.allgather_bucket_size);
  zo.reduction.overlap_comm = s.config.zero.overlap_comm || s.config.zero.stage == 0;
  // NOTE [gradient path]: how the reductions run and where the average's division happens.
  zo.reduction.comm_dtype = partition::communication_dtype(s.config);
  if (s.config.prescale_gradients) zo.reduction.pre_scale = 1.0 / static_cast<double>(s.dist.world_size);
  else if (s.config.gradient_predivide_factor != 1.0) zo.reduction.pre_scale = 1.0 / s.config.gradient_predivide_factor;
  zo.reduction.reduce_scatter = s.config.zero.reduce_scatter;
  // ZeRO++'s qgZ is stage 3's (NOTE [quantized gradients]); below it the config warns.
  zo.reduction.quantize_gradients = s.config.zero.stage == 3 && s.config.zero.zero_quantized_gradients;
  zo.reduction.quant_block = s.config.zero.zero_quantized_weights_block_size;
  zo.reduction.reuse_buckets = s.config.zero.contiguous_gradients;
  zo.average_gradients = s.config.gradient_allreduce_op != "sum";
  zo.compute_dtype = s.dtype;
  zo.grad_accum_dtype = s.grad_accum_dtype;
  zo.master_dtype = partition::master_dtype(s.config);
  zo.stochastic_rounding = zo.master_dtype == at::kHalf ? s.config.fp16.stochastic_rounding
                                                        : s.config.bf16.stochastic_rounding;
  zo.device = s.device;
  zo.sub_group_size = s.config.zero.sub_group_size;
  // DeepSpeed offloads the optimizer at stages 1-3 only (the config warns at stage 0).
  const auto& oo = s.config.zero.offload_optimizer;
  zo.offload_optimizer = oo.device != config::OffloadDevice::kNone && s.config.zero.stage >= 1;
  zo.pin_memory = oo.pin_memory;
  if (zo.offload_optimizer && oo.device == config::OffloadDevice::kNvme) {
    partition::SwapOptions so;
    so.nvme_path = oo.nvme_path;
    so.buffer_count = oo.buffer_count;
    so.pin_memory = oo.pin_memory;
    so.pipeline_read = oo.pipeline_read;
    so.pipeline_write = oo.pipeline_write;
    so.aio = partition::aio_options(s.config.aio);
    so.tag = "rank" + std::to_string(s.dist.rank);
    zo.nvme = so;
    zo.max_in_cpu = oo.max_in_cpu;  // NOTE [state placement]
  }
  // NOTE [partial offload] (the config refuses it elsewhere).
  if (zo.offload_optimizer && s.config.zero.stage == 3) zo.offload_ratio = oo.ratio;
  // NOTE [device gradients] (the config warns where it has no effect).
  zo.grads_on_device = oo.gradients_on_device && zo.offload_optimizer && s.config.zero.stage >= 2;
  zo.check_overflow = s.config.fp16.enabled || (s.config.bf16.enabled && s.config.bf16.check_grad_overflow);
  zo.copy_mode = s.options.cpu_copy_mode;
  // NOTE [speculative step]: where it runs (the config warns elsewhere).
  zo.super_offload = oo.super_offload && s.config.zero.stage == 3 && oo.device == config::OffloadDevice::kCpu &&
                     s.config.zero.offload_param.device == config::OffloadDevice::kNone && !zo.grads_on_device &&
                     zo.offload_ratio > 0.0;  // ratio 0: nothing on the host to speculate (the config warns)
  // NOTE [MiCS]: the states partitioned within shard groups of consecutive
  // ranks, replicated across them.
  s.mics.partition = s.comm.get();
  if (const int64_t shard = config::partition_ranks(s.config); s.comm && shard < s.dist.world_size) {
    s.mics = partition::make_mics_groups(*s.comm, shard);
    if (s.dist.rank == 0)
      log::info("MiCS: the model states are partitioned within " + std::to_string(s.dist.world_size / shard) +
                " groups of " + std::to_string(shard) + " consecutive ranks (zero_optimization.mics_shard_size) and "
                "replicated across them; each bucket's gradients are reduced within the group, then summed across "
                "the " + std::to_string(s.dist.world_size / shard) + " replicas");
  }
  if (s.config.zero.stage == 3) {
    auto b = partition::plan_stage3(s.model, s.config, s.options.layers, init != nullptr ? &init->built : nullptr,
                                    "rank" + std::to_string(s.dist.rank) + "-params", s.options.leaf_modules);
    if (s.dist.rank == 0) {
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "ZeRO stage 3: %zu layers gathered layer by layer (%lld parameters); %lld parameters always "
                    "gathered (outside every layer, or under stage3_param_persistence_threshold)",
                    b.layout.units.size(), static_cast<long long>(b.layer_params),
                    static_cast<long long>(b.always_params));
      log::info(buf);
      if (b.frozen_layer_params + b.frozen_whole_params > 0)  // NOTE [frozen groups]
        log::info("ZeRO stage 3: " + std::to_string(b.frozen_layer_params) +
                  " frozen parameters partitioned with their layers (no gradient, master or optimizer state), " +
                  std::to_string(b.frozen_whole_params) +
                  " kept whole on every rank (outside every layer, or under stage3_param_persistence_threshold)");
      // DeepSpeed's defaults keep a small model whole: say so plainly, or a
      // new user believes stage 3 is partitioning it.
      if (b.layer_params + b.frozen_layer_params == 0)
        log::info("ZeRO stage 3 partitions nothing of this model: every parameter is outside the layers or has at "
                  "most zero_optimization.stage3_param_persistence_threshold (" +
                  std::to_string(s.config.zero.param_persistence_threshold) +
                  ") elements, so every rank keeps all of them, as at stage 2; lower that key (0 partitions every "
                  "layer parameter) to see stage 3 at work");
    }
    // The parameter swapper takes Init's swap file over and counts all of
    // it: Init's count goes first, or the file would count twice against an
    // NVMe budget while the optimizer's swap files are made.
    if (init != nullptr) init->swap_disk = {};
    s.optimizer = std::make_unique<partition::ZeroOptimizer>(
        std::move(b.layout), optim::FlatOptimizer::create(*s.config.optimizer), zo, s.ledger(), s.mics.partition,
        s.mics.replicas);
    if (init != nullptr) {  // the shards now live in the partition (or its swap file)
      init->built.layers.clear();
      init->built.swap_file.reset();
      init->aio.reset();
    }
  } else {
    s.optimizer = std::make_unique<partition::ZeroOptimizer>(
        named, optim::FlatOptimizer::create(*s.config.optimizer), zo, s.ledger(), s.mics.partition, s.mics.replicas);
  }
  {  // NOTE [frozen groups]: the frozen parameters kept whole, counted.
    std::unordered_set<const void*> laid_out, seen;
    for (const auto& slot : s.optimizer->parameters().all_slots()) laid_out.insert(slot.param.unsafeGetTensorImpl());
    int64_t bytes = 0;
    for (const auto& item : s.model->named_parameters(/*recurse=*/true)) {
      const auto& p = item.value();
      if (p.requires_grad() || laid_out.count(p.unsafeGetTensorImpl()) > 0) continue;
      s.frozen_whole.emplace_back(item.key(), p);
      if (seen.insert(p.unsafeGetTensorImpl()).second) bytes += static_cast<int64_t>(p.nbytes());
    }
    if (bytes > 0)
      s.frozen_whole_bytes = LedgerAlloc::reserve(s.ledger(), Tier::kDevice, Kind::kFrozenParameters, bytes,
                                                  "frozen parameters kept whole on every rank");
  }
  if (s.optimizer->speculates() && s.dist.rank == 0)
    log::info("offload_optimizer.super_offload: each sub-group's CPU step begins during the boundary backward, as "
              "its gradients are complete, and is checked at step() (clipped: undone and redone; an fp16 overflow: "
              "undone and skipped; the same bits either way); it keeps an undo copy of the master and optimizer states in host memory, " +
              format_bytes(s.optimizer->speculation_undo_bytes()) + " a rank");
  if (!s.options.param_groups.empty()) apply_param_groups(s);
  s.optimizer->set_on_user_backward([&s] { begin_user_backward(s); });
  if (const auto* sw = s.optimizer->swapper(); sw != nullptr && s.dist.rank == 0) {
    log::info("optimizer states on NVMe under " + sw->options().nvme_path + ": " + format_bytes(sw->file_bytes()) +
              " of swap files per rank (opened, then unlinked: the space returns when the process ends), stepped in " +
              std::to_string(sw->num_sub_groups()) + " sub-groups through " + format_bytes(sw->buffer_bytes()) +
              " of host buffers" +
              (s.config.zero.offload_optimizer.max_in_cpu > 0
                   ? "; the first offloaded groups within zero_optimization.offload_optimizer.max_in_cpu (" +
                         std::to_string(s.config.zero.offload_optimizer.max_in_cpu) + " elements) stay in host memory"
                   : std::string()));
  } else if (zo.nvme && s.dist.rank == 0 && zo.offload_ratio > 0) {
    log::info("offload_optimizer nvme: every offloaded optimizer state of rank 0 fits within "
              "zero_optimization.offload_optimizer.max_in_cpu (" +
              std::to_string(s.config.zero.offload_optimizer.max_in_cpu) +
              " elements), so nothing goes to disk; lower that key (0, the default, puts every offloaded state on "
              "NVMe) to see NVMe offload at work");
  }
  if (const auto* ps = s.optimizer->param_swapper(); ps != nullptr && s.dist.rank == 0 && ps->swapped_numel() == 0) {
    log::info("offload_param nvme: every layer shard of rank 0 fits within zero_optimization.offload_param.max_in_cpu (" +
              std::to_string(s.config.zero.offload_param.max_in_cpu) + " elements), so nothing goes to disk; lower "
              "that key (0 puts every layer shard on NVMe) to see NVMe offload at work");
  } else if (ps != nullptr && s.dist.rank == 0) {
    log::info("stage-3 parameters on NVMe under " + s.config.zero.offload_param.nvme_path + ": " +
              std::to_string(ps->swapped_numel()) + " elements of rank 0's shards (" + format_bytes(ps->file_bytes()) +
              "), read for their gathers; the rest within offload_param.max_in_cpu stay in host memory");
  }
  if (s.config.scheduler) {
    s.scheduler = optim::LrScheduler::create(*s.config.scheduler, s.config.optimizer->lr,
                                             s.config.optimizer->betas[0]);
  }
  if (s.config.fp16.enabled) s.scaler = optim::LossScaler(s.config.fp16);
  s.checkpointer = std::make_unique<checkpointing::Checkpointer>(s.config.activation_checkpointing, &s.ledger(),
                                                                 nullptr, s.options.cpu_copy_mode);
  checkpointing::register_current(s.checkpointer.get());  // zero::checkpointing::checkpoint from the model's code
  if (s.config.zero.stage > 0 && !s.dist.distributed()) {
    log::info("ZeRO stage " + std::to_string(s.config.zero.stage) +
              " on one process: the single partition holds all model states");
  }
  s.phase_start = Clock::now();
  s.window_start = Clock::now();
  if (s.comm) s.comm_bytes_uncounted = s.comm->bytes_sent();  // initialize's: not a step's
  try {  // NOTE [run report]
    detail::check_environment_outputs(s.config.source, s.dist);
    start_trace(s);
    s.reporter = detail::RunReporter::start(s);
    if (s.reporter) s.reporter->after_initialize();
  } catch (...) {  // no destructor will run: the thread must not keep the checkpointer
    checkpointing::unregister_current(s.checkpointer.get());
    throw;
  }
}

bool Engine::stop_requested() const { return impl_->reporter && impl_->reporter->stop_due(); }  // (a tool's run ended already)

Engine::~Engine() {
  if (impl_ && trace::on()) trace::flush();  // NOTE [trace]; says, not throws, what it could not write
  if (impl_ && impl_->reporter) {
    try {
      impl_->reporter->at_engine_end();
    } catch (const std::exception& e) {
      log::warning(std::string("the run report (ZERO_RUN_REPORT) was not written: ") + error_text(e));
    }
    impl_->reporter.reset();
  }
  if (impl_ && impl_->checkpointer) checkpointing::unregister_current(impl_->checkpointer.get());
}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&& other) noexcept {
  if (this != &other) {
    // This engine's run ends as its destructor would end it (trace, run
    // report, the thread's checkpointer); a defaulted assignment would free
    // the state and leave the checkpointer registered.
    Engine ended(std::move(*this));
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void Engine::backward(const torch::Tensor& loss) {
  auto& s = *impl_;
  if (!loss.defined() || loss.numel() != 1) {
    throw UsageError("Engine::backward: expected a scalar loss; got a tensor of shape " +
                                        (loss.defined() ? c10::str(loss.sizes()) : std::string("(undefined)")));
  }
  recover_from_failed_backward(s);
  check_trainable_unchanged(s);
  if (s.window_backward == Impl::Backward::kUser)
    throw UsageError("Engine::backward: this accumulation window's earlier micro-steps ran loss.backward(); one "
                     "way per window (they scale gradients differently): step() first, or keep to one");
  s.window_backward = Impl::Backward::kEngine;
  s.sync_for_breakdown();
  const auto t0 = Clock::now();
  s.t_forward += std::chrono::duration<double>(t0 - s.phase_start).count();
  if (trace::on()) {  // the forward ran in the program, from the last phase's end to here
    const auto forward_us = std::chrono::duration_cast<std::chrono::microseconds>(t0 - s.phase_start).count();
    trace::detail::record_complete("phase", "forward", trace::detail::now_us() - forward_us, s.micro_steps);
  }
  const trace::Span span("phase", "backward", s.micro_steps);
  {
    torch::NoGradGuard no_grad;
    auto l = loss.detach().to(torch::kFloat).reshape({});
    s.loss_sum = s.loss_sum.defined() ? s.loss_sum + l : l;
    ++s.loss_count;
  }
  double factor = 1.0 / static_cast<double>(s.gas());
  if (s.config.fp16.enabled) factor *= s.scaler.scale();
  auto scaled = factor == 1.0 ? loss : loss * factor;
  // NOTE [speculative step]: the step this boundary's backward may begin,
  // with the factor take_model_step will pass (engine.backward's: the loss scale).
  std::optional<partition::PlannedStep> planned;
  if (is_gradient_accumulation_boundary() && s.optimizer->speculates())
    planned = partition::PlannedStep{s.next_step_params(), s.scaler.scale(), s.config.gradient_clipping};
  s.optimizer->begin_backward(is_gradient_accumulation_boundary(), planned);
  {
    // NOTE [user backward]: other engines this loss reaches read its factor.
    std::lock_guard<std::mutex> lock(g_factor_mutex);
    g_pass_factor = factor;
    g_next_factor = 0;
  }
  try {
    scaled.backward();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(g_factor_mutex);
      g_pass_factor = 0;
    }
    s.optimizer->abandon_backward();
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(g_factor_mutex);
    g_pass_factor = 0;
  }
  s.optimizer->end_backward();
  s.checkpointer->end_micro_step();
  s.sync_for_breakdown();
  s.phase_start = Clock::now();
  s.t_backward += std::chrono::duration<double>(s.phase_start - t0).count();
}

void Engine::check_batch(const torch::Tensor& batch) const {
  const auto& s = *impl_;
  const int64_t mbs = s.config.batch.train_micro_batch_size_per_gpu;
  if (batch.dim() < 1 || batch.size(0) != mbs)
    throw UsageError("the batch fed has shape " + c10::str(batch.sizes()) + "; " + s.config.source +
                     " says train_micro_batch_size_per_gpu " + std::to_string(mbs) +
                     " samples a rank per micro-step (the batch sizes, the learning rate schedule and the data "
                     "position are counted in them)");
  if (s.options.tokens_per_sample && batch.dim() >= 2 && batch.size(1) != *s.options.tokens_per_sample)
    throw UsageError("the batch fed has shape " + c10::str(batch.sizes()) + "; InitOptions::tokens_per_sample says " +
                     std::to_string(*s.options.tokens_per_sample) + " tokens a sample (the tokens/s the engine reports "
                     "count them)");
}

torch::Tensor Engine::scale(const torch::Tensor& loss) {
  auto& s = *impl_;
  const double factor = s.config.fp16.enabled ? s.scaler.scale() : 1.0;
  {
    std::lock_guard<std::mutex> lock(g_factor_mutex);
    g_next_factor = factor;
  }
  return factor == 1.0 ? loss : loss * factor;
}

void Engine::step() {
  auto& s = *impl_;
  recover_from_failed_backward(s);
  check_trainable_unchanged(s);
  const auto t0 = Clock::now();
  const bool boundary = is_gradient_accumulation_boundary();
  const trace::Span span("phase", boundary ? "step" : "step (accumulating)", s.global_steps);
  if (boundary) s.take_model_step();
  ++s.micro_steps;
  s.sync_for_breakdown();
  s.phase_start = Clock::now();
  s.t_step += std::chrono::duration<double>(s.phase_start - t0).count();
}

void Engine::zero_grad() { impl_->optimizer->zero_grad(); }

double Engine::get_lr() const { return impl_->current_lr(); }
int64_t Engine::global_steps() const { return impl_->global_steps; }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
int64_t Engine::skipped_steps() const { return impl_->skipped_steps; }
bool Engine::is_gradient_accumulation_boundary() const {
  return (impl_->micro_steps + 1) % impl_->gas() == 0;
}
double Engine::loss_scale() const { return impl_->scaler.scale(); }
double Engine::last_grad_norm() const { return impl_->last_grad_norm; }
const config::Config& Engine::config() const { return impl_->config; }
int Engine::rank() const { return impl_->dist.rank; }
int Engine::world_size() const { return impl_->dist.world_size; }
Comm* detail::comm_of(Engine& engine) { return engine.impl().comm.get(); }
detail::CollectiveTraffic detail::collective_traffic_of(const Engine& engine) {
  const auto& s = engine.impl();
  return {s.step_traffic(), s.steps_this_run, s.comm ? s.comm->node() : 0};
}
std::vector<torch::Tensor> detail::optimizer_states_of(Engine& engine) {
  std::vector<torch::Tensor> out;
  engine.impl().optimizer->read_states([&](size_t, at::Tensor m, std::vector<at::Tensor> st) {
    out.push_back(m.to(torch::kCPU).clone());
    for (auto& t : st) out.push_back(t.to(torch::kCPU).clone());
  });
  return out;
}
detail::SpeculationCounts detail::speculation_counts(const Engine& engine) {
  const auto c = engine.impl().optimizer->speculation_counts();
  return {c.planned, c.validated, c.redone, c.undone, c.sub_groups};
}
double Engine::grad_comm_wait_seconds() const { return impl_->optimizer->grad_comm_wait_seconds(); }
double Engine::param_gather_wait_seconds() const { return impl_->optimizer->param_gather_wait_seconds(); }
double Engine::transfer_wait_seconds() const { return impl_->optimizer->transfer_wait_seconds(); }
torch::Device Engine::device() const { return impl_->device; }
torch::ScalarType Engine::compute_dtype() const { return impl_->dtype; }
int64_t Engine::num_parameters() const { return impl_->optimizer->num_parameters(); }
double Engine::parameter_l2() const { return impl_->optimizer->parameter_l2(); }
MemoryLedger& Engine::ledger() { return impl_->ledger(); }
checkpointing::Checkpointer& Engine::checkpointer() { return *impl_->checkpointer; }

ParamGroup ParamGroup::by_name(std::string group_name, std::vector<std::string> suffixes, std::vector<std::string> names,
                               std::optional<double> weight_decay, std::optional<double> lr) {
  ParamGroup g;
  g.name = std::move(group_name);
  g.weight_decay = weight_decay;
  g.lr = lr;
  g.match = [suffixes = std::move(suffixes), names = std::move(names)](const std::string& n, const torch::Tensor&) {
    for (const auto& x : names)
      if (n == x) return true;
    for (const auto& x : suffixes)
      if (n.size() >= x.size() && n.compare(n.size() - x.size(), x.size(), x) == 0) return true;
    return false;
  };
  return g;
}

torch::Tensor Engine::all_reduce_mean(const torch::Tensor& tensor) {
  if (!tensor.is_floating_point())
    throw UsageError(std::string("all_reduce_mean: a mean needs a floating-point tensor; got ") +
                     c10::toString(tensor.scalar_type()) + " (convert it first: t.to(torch::kFloat64))");
  auto* comm = impl_->comm.get();
  torch::NoGradGuard no_grad;
  if (comm == nullptr) return tensor.detach().clone();
  // On the collectives' device (NCCL takes CUDA tensors only), summed, divided.
  at::Tensor t = tensor.detach().to(comm->device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
  comm->all_reduce_sum(t).wait();
  t.div_(static_cast<double>(comm->world_size()));
  return t.to(tensor.device());
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, config::Config config,
                  InitOptions options) {
  const DistEnv dist = options.dist ? *options.dist : DistEnv::from_environment();
  options.dist = dist;
  detail::print_config_warnings(config, dist, options.auto_value_flags);
  return Engine(std::move(model), std::move(config), std::move(options));
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, const std::string& config,
                  InitOptions options) {
  if (!options.dist) options.dist = DistEnv::from_environment();
  auto cfg = detail::load_config(config, options);
  return initialize(std::move(model), std::move(cfg), std::move(options));
}

}  // namespace zero
