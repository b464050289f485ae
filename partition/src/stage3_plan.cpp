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
                       const std::string& swap_tag) {
  LayerScan scan;
  for (const auto& m : extra_layers) scan.extra.insert(m.get());
  if (init != nullptr)
    for (const auto& [m, layer] : init->layers) scan.extra.insert(static_cast<const torch::nn::Module*>(m));
  scan.visit(model, "", nullptr, 0);
  {  // A listed layer that is not part of the model is a mistake worth naming.
    std::unordered_set<const torch::nn::Module*> in_model;
    for (const auto& m : model->modules(/*include_self=*/true)) in_model.insert(m.get());
    for (size_t i = 0; i < extra_layers.size(); ++i) {
      if (extra_layers[i] == nullptr || in_model.count(extra_layers[i].get()) == 0) {
        throw ConfigError({"InitOptions::layers[" + std::to_string(i) +
                           "]: expected a submodule of the model given to initialize; got " +
                           (extra_layers[i] == nullptr ? std::string("a null module")
                                                       : "a " + extra_layers[i]->name() + " outside it")});
      }
    }
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
      throw UsageError("a module partitioned by zero::Init (" + std::to_string(layer.params.size()) +
                       " parameters) is not a layer of the model given to initialize: it must be a child of a "
                       "ModuleList or Sequential, or be listed in InitOptions::layers");
    }
  }

  // Persistent parameters: Init's decisions for the layers it built, the
  // same rule for the rest (NOTE [stage-3 plan]).
  PersistenceRule fresh(c.zero.param_persistence_threshold, c.zero.model_persistence_threshold);
  PersistenceRule& rule = init != nullptr ? init->persistence : fresh;
  std::unordered_set<const void*> built;  // parameters of the layers Init built
  if (init != nullptr)
    for (const auto& [m, layer] : init->layers)
      for (const auto& p : layer.module->parameters(true)) built.insert(id(p));
  std::unordered_set<const void*> persistent, seen;
  for (const auto& item : model->named_parameters(true)) {
    const auto& p = item.value();
    if (!p.requires_grad() || !seen.insert(id(p)).second) continue;
    if (built.count(id(p)) > 0) {
      if (init->partitioned.count(id(p)) == 0) persistent.insert(id(p));  // Init kept it whole
    } else if (rule.keep_whole(p.numel())) {
      persistent.insert(id(p));
    }
  }

  Stage3Plan b;
  std::unordered_map<const void*, size_t> group_of;  // parameter -> group
  std::vector<GroupSpec> layer_groups;
  std::vector<int64_t> disk_offsets;  // per layer group: where zero::Init wrote its shard, or -1
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> layer_params(scan.layers.size());
  for (size_t u = 0; u < scan.layers.size(); ++u) {
    const auto& [name, m] = scan.layers[u];
    GroupSpec spec;
    spec.name = name;
    int64_t disk_offset = -1;
    if (init != nullptr) {
      if (auto it = init->layers.find(m.get()); it != init->layers.end()) {
        // Built under zero::Init: its shard is made; take the parameters in Init's order.
        auto named = m->named_parameters(true);
        for (size_t k = 0; k < it->second.params.size(); ++k) {
          const auto& p = it->second.params[k];
          std::string pname = name;
          for (const auto& item : named)
            if (id(item.value()) == id(p)) pname = join_name(name, item.key());
          spec.params.emplace_back(pname, p);
          group_of[id(p)] = layer_groups.size() + 1;
          b.layer_params += c10::multiply_integers(it->second.shapes[k]);
        }
        spec.chunk = it->second.chunk;
        spec.chunk_on_disk = it->second.disk_offset >= 0;
        spec.shapes = it->second.shapes;
        disk_offset = it->second.disk_offset;
      }
    }
    for (const auto& item : m->named_parameters(true)) {
      const auto& p = item.value();
      layer_params[u].emplace_back(join_name(name, item.key()), p);
      if (!p.requires_grad() || persistent.count(id(p)) > 0) continue;
      if (group_of.count(id(p)) > 0) continue;  // tied to an earlier layer, or built partitioned
      ZERO_CHECK(!spec.chunk.defined() && !spec.chunk_on_disk, "layer " + name + " mixes partitioned and whole parameters");
      group_of[id(p)] = layer_groups.size() + 1;
      spec.params.emplace_back(join_name(name, item.key()), p);
      b.layer_params += p.numel();
    }
    if (spec.params.empty()) continue;
    disk_offsets.push_back(disk_offset);
    layer_groups.push_back(std::move(spec));
  }
  GroupSpec always;
  always.name = "(always gathered)";
  for (const auto& item : model->named_parameters(true)) {
    const auto& p = item.value();
    if (!p.requires_grad() || group_of.count(id(p)) > 0) continue;
    always.params.emplace_back(item.key(), p);  // FlatParameters drops tied repeats
  }
  b.layout.groups.push_back(std::move(always));
  for (auto& g : layer_groups) b.layout.groups.push_back(std::move(g));
  for (const auto& p : b.layout.groups[0].params) b.always_params += p.second.numel();
  for (size_t u = 0; u < scan.layers.size(); ++u) {
    Stage3Unit unit;
    unit.name = scan.layers[u].first;
    unit.module = scan.layers[u].second;
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
          if (t.requires_grad() && counted.insert(id(t)).second) used += t.numel();
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
