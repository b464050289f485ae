// zero::GatheredParameters (engine.h): full parameters for a scope, and a
// modifier rank's change written where the engine keeps them.
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>

#include "engine_impl.h"
#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero {
namespace {

// The modifier rank's values to every rank, then what changed, by group:
// for a trainable group, this rank's chunk of the new values and a mask of
// the elements the modifier changed (only they reach the master: the
// others keep its bits, not the compute copy's rounding of them); for a
// frozen group, this rank's new chunk. Groups where nothing changed are
// left out. Every rank has the same values and originals, so the same
// groups: the writes' collectives pair up.
void broadcast_and_collect(Engine::Impl& s, const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& originals, int modifier,
                           std::map<size_t, partition::ZeroOptimizer::ChunkUpdate>& chunks,
                           std::vector<std::pair<size_t, at::Tensor>>& frozen) {
  const auto& flat = s.optimizer->parameters();
  const int64_t r = s.optimizer->partition_rank();
  if (s.comm != nullptr) {  // a parameter at a time, in the order given (the same on every rank)
    for (const auto& p : params) {
      at::Tensor t = p.detach();
      at::Tensor sent = t.is_contiguous() ? t : t.contiguous();
      s.comm->broadcast(sent, modifier).wait();
      if (!sent.is_same(t)) t.copy_(sent);
    }
  }
  std::unordered_map<const void*, size_t> changed;  // a changed parameter -> its index in params
  for (size_t i = 0; i < params.size(); ++i)
    if (!at::equal(params[i].detach().cpu(), originals[i].cpu())) changed.emplace(params[i].unsafeGetTensorImpl(), i);
  auto mask_of = [&](size_t g) {  // this rank's chunk of group g: the elements changed
    const auto& grp = flat.all_groups()[g];
    const int64_t lo = r * grp.chunk_numel, hi = lo + grp.chunk_numel;  // in group coordinates
    at::Tensor mask = at::zeros({grp.chunk_numel}, at::TensorOptions().dtype(at::kBool));
    for (size_t i : grp.slots) {
      const auto& slot = flat.all_slots()[i];
      const auto it = changed.find(slot.param.unsafeGetTensorImpl());
      if (it == changed.end()) continue;
      const int64_t p0 = slot.offset - grp.begin, a = std::max(lo, p0), b = std::min(hi, p0 + slot.numel);
      if (a >= b) continue;
      const at::Tensor now = params[it->second].detach().reshape({-1}).narrow(0, a - p0, b - a);
      const at::Tensor was = originals[it->second].reshape({-1}).narrow(0, a - p0, b - a);
      mask.narrow(0, a - lo, b - a).copy_(now.ne(was).cpu());
    }
    return mask;
  };
  // Each group holding a changed parameter, in group order.
  std::set<size_t> groups;
  for (size_t g = 0; g < flat.all_groups().size(); ++g)
    for (size_t i : flat.all_groups()[g].slots)
      if (changed.count(flat.all_slots()[i].param.unsafeGetTensorImpl()) > 0) groups.insert(g);
  for (size_t g : groups) {
    const auto& grp = flat.all_groups()[g];
    // Stage 3: the gathered tensor (held); below it, the flat buffer the parameters view.
    at::Tensor chunk = flat.stage3() ? flat.full(g).narrow(0, r * grp.chunk_numel, grp.chunk_numel).clone()
                                     : flat.chunk_of(flat.flat(), g, r).clone();
    if (grp.frozen) frozen.emplace_back(g, chunk);
    else chunks[g] = {chunk, mask_of(g)};
  }
}

}  // namespace

GatheredParameters::GatheredParameters(Engine& engine, std::vector<torch::Tensor> params,
                                       std::optional<int> modifier_rank)
    : engine_(&engine), params_(std::move(params)), modifier_(modifier_rank) {
  auto& s = engine.impl();
  if (modifier_ && (*modifier_ < 0 || *modifier_ >= s.dist.world_size))
    throw UsageError("GatheredParameters: modifier_rank " + std::to_string(*modifier_) + " is not a rank of this job (0.." +
                     std::to_string(s.dist.world_size - 1) + ")");
  if (s.optimizer->in_backward())
    throw UsageError("GatheredParameters during backward: make it between steps (its gathers would interleave with "
                     "backward's)");
  std::unordered_set<const void*> of_model;
  for (const auto& item : s.model->named_parameters(true)) of_model.insert(item.value().unsafeGetTensorImpl());
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].defined() || of_model.count(params_[i].unsafeGetTensorImpl()) == 0)
      throw UsageError("GatheredParameters: params[" + std::to_string(i) +
                       "] is not a parameter of the engine's model (give the model's own tensors, "
                       "model->named_parameters())");
  auto* c = s.optimizer->stage3();
  ++s.gathered_scopes;  // done() ends it
  auto keep_originals = [&] {  // what a modifier's change is told from
    if (modifier_)
      for (const auto& p : params_) originals_.push_back(p.detach().clone());
  };
  if (c == nullptr) {  // below stage 3 every parameter is whole
    keep_originals();
    return;
  }
  const auto& flat = s.optimizer->parameters();
  std::unordered_map<const void*, size_t> group_of;
  for (size_t g = 0; g < flat.all_groups().size(); ++g)
    for (size_t i : flat.all_groups()[g].slots) group_of[flat.all_slots()[i].param.unsafeGetTensorImpl()] = g;
  std::set<size_t> groups;  // in group order on every rank: the gathers pair up
  for (const auto& p : params_)
    if (auto it = group_of.find(p.unsafeGetTensorImpl()); it != group_of.end()) groups.insert(it->second);
  try {
    for (size_t g : groups) held_.emplace_back(g, c->hold(g));
  } catch (...) {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) c->unhold(it->first, it->second);
    held_.clear();
    --s.gathered_scopes;
    throw;
  }
  keep_originals();
}

GatheredParameters::~GatheredParameters() {
  if (done_) return;
  try {
    done();
  } catch (const std::exception& e) {
    log::warning(std::string("GatheredParameters: ending the scope failed: ") + e.what() +
                 " (call done() to have the error thrown)");
  }
}

void GatheredParameters::done() {
  if (done_) return;
  done_ = true;
  auto& s = engine_->impl();
  --s.gathered_scopes;
  auto* c = s.optimizer->stage3();
  auto release = [&] {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) c->unhold(it->first, it->second);
    held_.clear();
  };
  if (!modifier_) {
    if (c != nullptr) release();
    return;
  }
  at::NoGradGuard no_grad;
  std::map<size_t, partition::ZeroOptimizer::ChunkUpdate> chunks;  // trainable groups
  std::vector<std::pair<size_t, at::Tensor>> frozen;                // frozen groups' new chunks
  try {
    broadcast_and_collect(s, params_, originals_, *modifier_, chunks, frozen);
  } catch (...) {
    if (c != nullptr) release();
    throw;
  }
  if (c != nullptr) release();  // written below, released first: a write drops what was gathered
  for (const auto& [g, chunk] : frozen) s.optimizer->write_frozen_shard(g, chunk);
  if (!chunks.empty()) s.optimizer->set_values(chunks);
}

}  // namespace zero
