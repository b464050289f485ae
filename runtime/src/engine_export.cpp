// Whole weights out of the engine: save_hf (Hugging Face's layout, shards
// streamed a group at a time) and save_16bit_model (DeepSpeed's call: one
// safetensors file, or the torch pickle it wrote before).
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/serialize.h>

#include "engine_checkpoint.h"
#include "engine_impl.h"
#include "zero/core/error.h"
#include "zero/core/text.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/partition/stage3_plan.h"
#include "zero/snapshots/hf_export.h"

namespace zero {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Each rank's part of a failure reaches every rank (only rank 0 writes; the
// gathers are everyone's): the others throw too, naming rank 0.
void agree_on(Comm* comm, const std::exception_ptr& mine, const std::string& what) {
  const int64_t failed = mine ? 1 : 0;
  const auto all = comm != nullptr ? comm->exchange(failed, what) : std::vector<int64_t>{failed};
  if (mine) std::rethrow_exception(mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != 0) throw IoError(what + ": rank " + std::to_string(r) + " failed (its own error names the cause)");
}

}  // namespace

// The model's parameters as the engine holds them (gathered a group at a
// time at stage 3), each under its first name, then the buffers and frozen
// parameters, to `write` on rank 0 in that order; every rank takes part.
void detail::for_each_model_tensor(Engine& engine, const ModelTensorVisit& write) {
  auto& s = engine.impl();
  at::NoGradGuard no_grad;
  auto* coordinator = s.optimizer->stage3();
  const bool writer = s.dist.rank == 0;
  const auto& params = s.optimizer->parameters();
  // Stage 3's frozen groups too (NOTE [frozen groups]), after the trainable ones.
  for (size_t g = 0; g < params.all_groups().size(); ++g) {
    auto take = [&] {
      if (!writer) return;
      for (size_t i : params.all_groups()[g].slots) {
        const auto& p = params.all_slots()[i].param;
        write(params.all_slots()[i].name, p.detach(), p.unsafeGetTensorImpl());
      }
    };
    if (coordinator != nullptr) coordinator->with_gathered(g, take);
    else take();
  }
  if (!writer) return;
  std::unordered_map<const void*, bool> laid_out;
  for (const auto& slot : params.all_slots()) laid_out[slot.param.unsafeGetTensorImpl()] = true;
  for (const auto& item : s.model->named_parameters(true))
    if (!item.value().requires_grad() && !laid_out.count(item.value().unsafeGetTensorImpl()))
      write(item.key(), item.value().detach(), item.value().unsafeGetTensorImpl());
  for (const auto& item : s.model->named_buffers(true))
    if (item.value().defined()) write(item.key(), item.value().detach(), item.value().unsafeGetTensorImpl());
}

namespace {
// Gathering is what save_hf does; DeepSpeed asks for the key, and so does zero.
std::string gather_problem(const Engine::Impl& s) {
  if (s.optimizer->stage3() == nullptr || s.config.zero.gather_16bit_weights_on_model_save) return "";
  return s.config.source + ": zero_optimization.stage3_gather_16bit_weights_on_model_save: expected true to save "
                           "whole weights at stage 3 (each rank holds only its shards); got false";
}
}  // namespace

std::string Engine::save_hf_problem(const std::string& flag, const std::string& dir, bool with_config) const {
  const auto& s = *impl_;
  if (std::string p = gather_problem(s); !p.empty()) return flag + " " + dir + ": " + p;
  if (std::string p = ckpt::HfWriter::folder_problem(flag, dir, with_config); !p.empty()) return p;
  // Room for the export (in the model's dtype: the default), checked before
  // training rather than found short after it. The fresh folder is written
  // whole before an earlier export goes.
  int64_t bytes = 0;
  const auto& params = s.optimizer->parameters();
  for (const auto& slot : params.all_slots())
    bytes += c10::multiply_integers(slot.shape) * static_cast<int64_t>(c10::elementSize(s.dtype));
  std::string at = dir;
  while (!ckpt::is_folder(at)) {
    const auto slash = at.find_last_of('/');
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
  const int64_t free = detail::checkpoints::statvfs_free(at);
  if (free >= 0 && free < bytes)
    return flag + " " + dir + ": the export needs about " + format_bytes(bytes) + " and " + at + "'s file system has " +
           format_bytes(free) + " free; free some space, or export elsewhere";
  return "";
}

void Engine::save_hf(const std::string& dir, const SaveHfOptions& options) {
  auto& s = *impl_;
  const std::string what = "save_hf " + dir;
  if (std::string p = gather_problem(s); !p.empty()) throw ConfigError({p});
  const at::ScalarType dtype = options.dtype.value_or(s.dtype);
  if (c10::elementSize(dtype) > c10::elementSize(s.dtype) || !at::isFloatingType(dtype))
    throw UsageError(what + ": dtype " + std::string(ckpt::dtype_name(dtype)) + " from a model that computes in " +
                     ckpt::dtype_name(s.dtype) + " would only pad the values it holds; the master (fp32 unless 16-bit) is in the "
                     "engine's checkpoints: save_checkpoint, then `zero checkpoint export --hf --dtype fp32`");
  auto rename = [&](const std::string& n) {
    std::string out = n;
    if (!options.strip_prefix.empty() && out.rfind(options.strip_prefix, 0) == 0) out = out.substr(options.strip_prefix.size());
    return options.add_prefix + out;
  };
  // SaveHfOptions::lora_scaling: the bases that have adapters, and the
  // adapters' values as they come (before the bases: the adapters train,
  // and the trainable groups come first).
  auto lora_base = [](const std::string& n, std::string* kind) -> std::string {
    for (const char* k : {".lora_A.weight", ".lora_B.weight"}) {
      const std::string key(k);
      if (n.size() > key.size() && n.compare(n.size() - key.size(), key.size(), key) == 0) {
        if (kind != nullptr) *kind = key.substr(1, 6);
        return n.substr(0, n.size() - key.size()) + ".weight";
      }
    }
    return "";
  };
  const bool merge = options.lora_scaling.has_value();
  std::unordered_map<std::string, std::pair<at::Tensor, at::Tensor>> adapters;  // base name -> (A, B), rank 0's
  if (merge) {
    std::unordered_map<std::string, const at::Tensor*> by_name;
    for (const auto& item : s.model->named_parameters(true)) by_name[item.key()] = &item.value();
    int found = 0;
    for (const auto& item : s.model->named_parameters(true)) {
      const std::string base = lora_base(item.key(), nullptr);
      if (base.empty()) continue;
      ++found;
      if (!item.value().requires_grad())
        throw UsageError(what + ": lora_scaling: the adapter " + item.key() + " is frozen; a merge folds trained "
                         "adapters into a frozen base (export without lora_scaling)");
      auto it = by_name.find(base);
      if (it == by_name.end())
        throw UsageError(what + ": lora_scaling: " + item.key() + " has no base " + base + " to merge into");
      if (it->second->requires_grad())
        throw UsageError(what + ": lora_scaling: " + base + " trains beside its adapters; a merge folds adapters "
                         "into a frozen base (export without lora_scaling, or freeze it)");
    }
    if (found == 0) throw UsageError(what + ": lora_scaling: the model has no LoRA adapter (X.lora_A.weight)");
  }
  // Every rank plans (the names and shapes are everyone's); rank 0 writes.
  std::vector<ckpt::HfWriter::Tensor> plan;
  const auto& params = s.optimizer->parameters();
  for (const auto& grp : params.all_groups())
    for (size_t i : grp.slots)
      if (!merge || lora_base(params.all_slots()[i].name, nullptr).empty())
        plan.push_back({rename(params.all_slots()[i].name), dtype, params.all_slots()[i].shape});
  std::unordered_map<const void*, bool> laid_out;
  for (const auto& slot : params.all_slots()) laid_out[slot.param.unsafeGetTensorImpl()] = true;
  for (const auto& item : s.model->named_parameters(true))
    if (!item.value().requires_grad() && !laid_out.count(item.value().unsafeGetTensorImpl()))
      plan.push_back({rename(item.key()), item.value().is_floating_point() ? dtype : item.value().scalar_type(),
                      item.value().sizes().vec()});
  for (const auto& item : s.model->named_buffers(true))
    if (item.value().defined())
      plan.push_back({rename(item.key()), item.value().is_floating_point() ? dtype : item.value().scalar_type(),
                      item.value().sizes().vec()});
  std::exception_ptr failed;
  std::unique_ptr<offload::AioEngine> aio;
  std::unique_ptr<ckpt::HfWriter> writer;
  if (s.dist.rank == 0) {
    try {
      aio = std::make_unique<offload::AioEngine>(partition::aio_options(s.config.aio));
      writer = std::make_unique<ckpt::HfWriter>(dir, plan, options.max_shard_bytes, *aio);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree_on(s.comm.get(), failed, what);
  // A failure while writing stops the writing, not the gathers (the other
  // ranks are in them): it is told once every group has gone by.
  detail::for_each_model_tensor(*this, [&](const std::string& name, const at::Tensor& t, const void*) {
    if (failed) return;
    try {
      if (merge) {
        std::string kind;
        if (const std::string base = lora_base(name, &kind); !base.empty()) {
          auto& ab = adapters[base];
          (kind == "lora_A" ? ab.first : ab.second) = t.to(at::kCPU, at::kFloat, false, /*copy=*/true);
          return;
        }
        if (auto it = adapters.find(name); it != adapters.end()) {
          const auto& [a, b] = it->second;
          ZERO_CHECK(a.defined() && b.defined(), "an adapter of " + name + " came after its base");
          const at::Tensor merged = t.to(at::kCPU, at::kFloat) + at::matmul(b, a) * *options.lora_scaling;
          writer->append(merged.to(t.scalar_type()));
          return;
        }
      }
      writer->append(t);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  if (s.dist.rank == 0 && !failed) {
    try {
      writer->finish(options.config_json);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  writer.reset();
  agree_on(s.comm.get(), failed, what);
}

void Engine::save_16bit_model(const std::string& path) {
  auto& s = *impl_;
  if (s.optimizer->stage3() != nullptr && !s.config.zero.gather_16bit_weights_on_model_save) {
    throw ConfigError({s.config.source + ": zero_optimization.stage3_gather_16bit_weights_on_model_save: expected "
                       "true to save whole 16-bit weights at stage 3 (each rank holds only its shards); got false"});
  }
  if (ends_with(path, ".safetensors")) {
    // One file: an export of one shard, moved to its name.
    const auto slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    const std::string scratch = dir + "/.zero-16bit-" + std::to_string(::getpid());
    // Only rank 0 writes: its scratch folder goes whatever happens, and its
    // failure to move the file reaches every rank.
    SaveHfOptions o;
    o.max_shard_bytes = INT64_MAX;
    auto drop_scratch = [&] {
      if (s.dist.rank != 0) return;
      try {
        ckpt::remove_tree(scratch);
      } catch (const std::exception&) {  // the error that ended the save says more
      }
    };
    try {
      save_hf(scratch, o);
    } catch (...) {
      drop_scratch();
      throw;
    }
    std::exception_ptr failed;
    if (s.dist.rank == 0) {
      try {
        ckpt::rename_path(scratch + "/model.safetensors", path);
        ckpt::sync_path(dir);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    drop_scratch();
    agree_on(s.comm.get(), failed, "save_16bit_model " + path);
    return;
  }
  // The pickle DeepSpeed's save_16bit_model writes (pytorch_model.bin): Python
  // reads it with torch.load(path, weights_only=False).
  const bool writer = s.dist.rank == 0;
  c10::Dict<std::string, at::Tensor> dict;
  std::unordered_map<const void*, at::Tensor> values;
  detail::for_each_model_tensor(*this, [&](const std::string& name, const at::Tensor& t, const void* identity) {
    const at::Tensor v = t.clone().cpu();
    values[identity] = v;
    dict.insert(name, v);
  });
  std::exception_ptr failed;
  if (writer) {
    try {
      // Every name the model has (a tied parameter under each of them).
      for (const auto& item : s.model->named_parameters(true)) {
        if (dict.contains(item.key())) continue;
        auto it = values.find(item.value().unsafeGetTensorImpl());
        dict.insert(item.key(), it != values.end() ? it->second : item.value().detach().clone().cpu());
      }
      const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
      ckpt::write_file_atomically(path, std::string(bytes.begin(), bytes.end()));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree_on(s.comm.get(), failed, "save_16bit_model " + path);
}

}  // namespace zero
