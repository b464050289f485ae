// NOTE [stage-3 plan] in stage3_plan.h.
#include "zero/partition/stage3_plan.h"

#include <algorithm>

#include <c10/util/accumulate.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include "zero/core/error.h"
#include "zero/partition/layer.h"

namespace zero::partition {
namespace {

// A Sequential entry that runs its module as a stage-3 layer.
class Stage3EntryImpl : public torch::nn::Module {
 public:
  Stage3EntryImpl(torch::nn::AnyModule inner, std::shared_ptr<torch::nn::Module> layer)
      : inner_(std::move(inner)), layer_(std::move(layer)) {}
  torch::Tensor forward(torch::Tensor x) {
    return layer_forward(*layer_, x, [this](const torch::Tensor& t) { return inner_.forward(t); });
  }

 private:
  torch::nn::AnyModule inner_;
  std::shared_ptr<torch::nn::Module> layer_;
};

bool is_container(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&m) != nullptr;
}

std::string join_name(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

const void* id(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// The layers, in the model's order, none inside another.
struct LayerScan {
  std::unordered_set<const torch::nn::Module*> extra;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> layers;
  // Sequential entries to route through layer_forward: (container, index).
  std::vector<std::pair<torch::nn::SequentialImpl*, size_t>> entries;

  void visit(const std::shared_ptr<torch::nn::Module>& m, const std::string& name, torch::nn::Module* parent,
             size_t index) {
    const bool parent_container = parent != nullptr && is_container(*parent);
    if (parent_container || extra.count(m.get()) > 0) {
      layers.emplace_back(name, m);
      if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(parent)) entries.emplace_back(seq, index);
      return;
    }
    size_t i = 0;
    for (const auto& item : m->named_children()) visit(item.value(), join_name(name, item.key()), m.get(), i++);
  }
};

}  // namespace

offload::AioOptions aio_options(const config::AioConfig& a) {
  offload::AioOptions o;
  o.block_size = a.block_size;
  o.queue_depth = a.queue_depth;
  o.threads = a.intra_op_parallelism;
  o.single_submit = a.single_submit;
  o.overlap_events = a.overlap_events;
  return o;
}

Stage3Plan plan_stage3(const std::shared_ptr<torch::nn::Module>& model, const config::Config& c,
                       const std::vector<std::shared_ptr<torch::nn::Module>>& extra_layers, Prebuilt* init,
                       const std::string& swap_tag,
                       const std::vector<std::shared_ptr<torch::nn::Module>>& leaf_modules) {
  LayerScan scan;
  for (const auto& m : extra_layers) scan.extra.insert(m.get());
  std::unordered_set<const torch::nn::Module*> leaves;  // NOTE [leaf modules]
  for (const auto& m : leaf_modules) leaves.insert(m.get());
  for (const auto& m : model->modules(/*include_self=*/false))
    if (is_leaf(*m)) leaves.insert(m.get());  // zero::set_leaf's
  scan.extra.insert(leaves.begin(), leaves.end());
  if (init != nullptr)
    for (const auto& [m, layer] : init->layers) scan.extra.insert(static_cast<const torch::nn::Module*>(m));
  scan.visit(model, "", nullptr, 0);
  {  // A listed layer that is not part of the model is a mistake worth naming.
    std::unordered_set<const torch::nn::Module*> in_model;
    for (const auto& m : model->modules(/*include_self=*/true)) in_model.insert(m.get());
    auto check = [&](const std::vector<std::shared_ptr<torch::nn::Module>>& listed, const char* what) {
      for (size_t i = 0; i < listed.size(); ++i) {
        if (listed[i] == nullptr || in_model.count(listed[i].get()) == 0) {
          throw ConfigError({std::string(what) + "[" + std::to_string(i) +
                             "]: expected a submodule of the model given to initialize; got " +
                             (listed[i] == nullptr ? std::string("a null module")
                                                   : "a " + listed[i]->name() + " outside it")});
        }
      }
    };
    check(extra_layers, "InitOptions::layers");
    check(leaf_modules, "InitOptions::leaf_modules");
  }
  {  // NOTE [leaf modules]: a leaf inside another layer is part of that layer: fine. A
     // leaf the model itself is has nothing to gather around.
    if (is_leaf(*model) || std::find(leaf_modules.begin(), leaf_modules.end(), model) != leaf_modules.end())
      throw ConfigError({"InitOptions::leaf_modules: expected a submodule of the model; got the model itself (the "
                         "model's forward is not run through zero::forward: make its blocks leaf modules)"});
  }
  // Before anything of the model changes: a live engine's layers are its own.
  for (const auto& [name, m] : scan.layers) {
    if (find_layer(*m).coordinator != nullptr)
      throw UsageError("stage 3: layer " + name + " belongs to another live engine; one engine per model");
  }
  if (init != nullptr) {
    std::unordered_set<const void*> found;
    for (const auto& [name, m] : scan.layers) found.insert(m.get());
    for (const auto& [m, layer] : init->layers) {
      if (found.count(m) > 0) continue;
      throw UsageError("a module partitioned by zero::Init (" + std::to_string(layer.trainable.params.size() + layer.frozen.params.size()) +
                       " parameters) is not a layer of the model given to initialize: it must be a child of a "
                       "ModuleList or Sequential, or be listed in InitOptions::layers");
    }
  }

  std::unordered_map<const void*, std::string> name_of;  // a parameter's first name
  for (const auto& item : model->named_parameters(true)) name_of.emplace(id(item.value()), item.key());
  // NOTE [frozen groups]: zero::Init put each parameter on the side it was
  // on then; one that changed sides since cannot be laid out as it was.
  if (init != nullptr) {
    for (const auto& [m, layer] : init->layers) {
      for (const auto* grp : {&layer.trainable, &layer.frozen}) {
        const bool frozen = grp == &layer.frozen;
        for (const auto& p : grp->params) {
          if (p.requires_grad() != frozen) continue;
          auto it = name_of.find(id(p));
          throw UsageError(
              "parameter " + (it != name_of.end() ? it->second : std::string("of a layer built under zero::Init")) +
              (frozen ? " was frozen when zero::Init partitioned it and needs a gradient now"
                      : " was trainable when zero::Init partitioned it and is frozen now (requires_grad false)") +
              ": its shard was made with the layer's " + (frozen ? "frozen" : "trainable") +
              " parameters; say which parameters train before the model is built (InitOptions::trainable, "
              "zero::trainable_matching), or set requires_grad before Init::partition");
        }
      }
    }
  }

  // Persistent parameters: Init's decisions for the layers it built, the
  // same rule for the rest (NOTE [stage-3 plan]), frozen or not.
  PersistenceRule fresh(c.zero.param_persistence_threshold, c.zero.model_persistence_threshold);
  PersistenceRule& rule = init != nullptr ? init->persistence : fresh;
  std::unordered_set<const void*> built;  // parameters of the layers Init built
  if (init != nullptr)
    for (const auto& [m, layer] : init->layers)
      for (const auto& p : layer.module->parameters(true)) built.insert(id(p));
  std::unordered_set<const void*> persistent, seen;
  for (const auto& item : model->named_parameters(true)) {
    const auto& p = item.value();
    if (!seen.insert(id(p)).second) continue;
    if (built.count(id(p)) > 0) {
      if (init->partitioned.count(id(p)) == 0) persistent.insert(id(p));  // Init kept it whole
    } else if (rule.keep_whole(p.numel())) {
      persistent.insert(id(p));
    }
  }

  Stage3Plan b;
  // parameter -> group; a frozen group's index is kFrozen + its place among
  // the frozen groups until every trainable group is known (they come first).
  constexpr size_t kFrozen = size_t{1} << 40;
  std::unordered_map<const void*, size_t> group_of;
  std::vector<GroupSpec> layer_groups, frozen_groups;
  // per group: where zero::Init wrote its shard, or -1
  std::vector<int64_t> disk_offsets, frozen_disk_offsets;
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> layer_params(scan.layers.size());
  for (size_t u = 0; u < scan.layers.size(); ++u) {
    const auto& [name, m] = scan.layers[u];
    GroupSpec spec, fspec;
    spec.name = fspec.name = name;
    fspec.frozen = true;
    int64_t disk_offset = -1, frozen_disk_offset = -1;
    auto index_of = [&](bool frozen) {
      return frozen ? kFrozen + frozen_groups.size() : layer_groups.size() + 1;
    };
    if (init != nullptr) {
      if (auto it = init->layers.find(m.get()); it != init->layers.end()) {
        // Built under zero::Init: its shards are made; take the parameters in Init's order.
        auto named = m->named_parameters(true);
        for (const bool frozen : {false, true}) {
          const PrebuiltGroup& pg = frozen ? it->second.frozen : it->second.trainable;
          GroupSpec& target = frozen ? fspec : spec;
          for (size_t k = 0; k < pg.params.size(); ++k) {
            const auto& p = pg.params[k];
            std::string pname = name;
            for (const auto& item : named)
              if (id(item.value()) == id(p)) pname = join_name(name, item.key());
            target.params.emplace_back(pname, p);
            group_of[id(p)] = index_of(frozen);
            (frozen ? b.frozen_layer_params : b.layer_params) += c10::multiply_integers(pg.shapes[k]);
          }
          if (pg.empty()) continue;
          target.chunk = pg.chunk;
          target.chunk_on_disk = pg.disk_offset >= 0;
          target.shapes = pg.shapes;
          (frozen ? frozen_disk_offset : disk_offset) = pg.disk_offset;
        }
      }
    }
    for (const auto& item : m->named_parameters(true)) {
      const auto& p = item.value();
      layer_params[u].emplace_back(join_name(name, item.key()), p);
      if (persistent.count(id(p)) > 0) continue;
      if (group_of.count(id(p)) > 0) continue;  // tied to an earlier layer, or built partitioned
      const bool frozen = !p.requires_grad();
      GroupSpec& target = frozen ? fspec : spec;
      ZERO_CHECK(!target.chunk.defined() && !target.chunk_on_disk, "layer " + name + " mixes partitioned and whole parameters");
      group_of[id(p)] = index_of(frozen);
      target.params.emplace_back(join_name(name, item.key()), p);
      (frozen ? b.frozen_layer_params : b.layer_params) += p.numel();
    }
    if (!spec.params.empty()) {
      disk_offsets.push_back(disk_offset);
      layer_groups.push_back(std::move(spec));
    }
    if (!fspec.params.empty()) {
      frozen_disk_offsets.push_back(frozen_disk_offset);
      frozen_groups.push_back(std::move(fspec));
    }
  }
  // NOTE [frozen groups]: after every trainable group.
  for (auto& [p, g] : group_of)
    if (g >= kFrozen) g = g - kFrozen + layer_groups.size() + 1;
  disk_offsets.insert(disk_offsets.end(), frozen_disk_offsets.begin(), frozen_disk_offsets.end());
  GroupSpec always;
  always.name = "(always gathered)";
  std::unordered_set<const void*> counted_whole;
  for (const auto& item : model->named_parameters(true)) {
    const auto& p = item.value();
    if (group_of.count(id(p)) > 0) continue;
    if (!p.requires_grad()) {  // frozen and whole: not in any group
      if (counted_whole.insert(id(p)).second) b.frozen_whole_params += p.numel();
      continue;
    }
    always.params.emplace_back(item.key(), p);  // FlatParameters drops tied repeats
  }
  b.layout.groups.push_back(std::move(always));
  for (auto& g : layer_groups) b.layout.groups.push_back(std::move(g));
  for (auto& g : frozen_groups) b.layout.groups.push_back(std::move(g));
  for (const auto& p : b.layout.groups[0].params) b.always_params += p.second.numel();
  for (size_t u = 0; u < scan.layers.size(); ++u) {
    Stage3Unit unit;
    unit.name = scan.layers[u].first;
    unit.module = scan.layers[u].second;
    unit.leaf = leaves.count(unit.module.get()) > 0;
    for (const auto& [n, p] : layer_params[u]) {
      auto it = group_of.find(id(p));
      if (it != group_of.end() && std::find(unit.groups.begin(), unit.groups.end(), it->second) == unit.groups.end())
        unit.groups.push_back(it->second);
    }
    if (!unit.groups.empty()) b.layout.units.push_back(std::move(unit));
  }
  for (const auto& [seq, index] : scan.entries) {
    auto it = seq->begin() + static_cast<std::ptrdiff_t>(index);
    auto layer = it->ptr();
    *it = torch::nn::AnyModule(std::make_shared<Stage3EntryImpl>(std::move(*it), layer));
  }
  b.layout.options.prefetch_bucket_numel = c.zero.prefetch_bucket_size;
  b.layout.options.max_live_numel = c.zero.max_live_parameters;
  b.layout.options.max_reuse_distance = c.zero.max_reuse_distance;
  b.layout.options.quantize_weights = c.zero.zero_quantized_weights;
  b.layout.options.quant_block = c.zero.zero_quantized_weights_block_size;
  b.layout.options.hpz_partition_size = c.zero.zero_hpz_partition_size;
  b.layout.options.hierarchical_gather = c.zero.mics_hierarchical_params_gather && c.zero.mics_shard_size > 0;
  const auto& op = c.zero.offload_param;
  b.layout.offload_param = op.device != config::OffloadDevice::kNone;
  b.layout.pin_param = op.pin_memory;
  if (op.device == config::OffloadDevice::kNvme) {
    ParamSwapOptions p;
    p.swap.nvme_path = op.nvme_path;
    p.swap.config_key = "zero_optimization.offload_param";
    p.swap.buffer_count = op.buffer_count;
    p.swap.pin_memory = op.pin_memory;
    p.swap.aio = aio_options(c.aio);
    p.swap.tag = swap_tag;
    p.buffer_size = op.buffer_size;
    p.max_in_cpu = op.max_in_cpu;
    // Which shards stay in host memory: Init's choice for what it built, the
    // budget in group order for the rest (NOTE [stage-3 plan]).
    InCpuBudget fresh_budget(op.max_in_cpu);
    InCpuBudget& budget = init != nullptr ? init->in_cpu : fresh_budget;
    const int64_t ws = config::partition_ranks(c);  // NOTE [MiCS]: a shard group's
    p.in_memory.assign(1, true);  // group 0: always gathered, never on disk
    std::unordered_set<const void*> counted;
    for (size_t g = 1; g < b.layout.groups.size(); ++g) {
      const auto& spec = b.layout.groups[g];
      if (spec.chunk_on_disk) {
        p.in_memory.push_back(false);
      } else if (spec.chunk.defined()) {
        p.in_memory.push_back(true);  // Init kept it (and counted it)
      } else {
        int64_t used = 0;
        for (const auto& [n, t] : spec.params)
          if (t.requires_grad() != spec.frozen && counted.insert(id(t)).second) used += t.numel();
        p.in_memory.push_back(budget.keep(FlatParameters::padded_size(used, ws) / ws));
      }
    }
    if (init != nullptr && init->swap_file != nullptr) {  // shards zero::Init already wrote
      if (init->finish_writes) init->finish_writes();
      p.adopted_file = init->swap_file;
      p.adopted_bytes = init->swap_bytes;
      p.adopted_offsets.assign(1, -1);  // group 0: always gathered, never on disk
      p.adopted_offsets.insert(p.adopted_offsets.end(), disk_offsets.begin(), disk_offsets.end());
    }
    b.layout.nvme_param = p;
  }
  return b;
}

}  // namespace zero::partition
