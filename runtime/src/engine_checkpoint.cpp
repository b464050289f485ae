// Engine checkpoints (docs/checkpoints.md, NOTE [checkpoint mapping], NOTE
// [checkpoint commit]): save_checkpoint and open_checkpoint_dir in
// engine_save.cpp, load_checkpoint and load_weights in engine_load.cpp, what
// they share here (engine_checkpoint.h).
//
// NOTE [checkpoint commit]
// A save never touches the checkpoint it may replace until the new one is
// whole. Rank 0 makes DIR/.TAG.incoming (removing a leftover of an
// interrupted save), every rank checks its disk has room, writes its files
// there (each through a temporary name, flushed, then renamed), and the ranks
// tell rank 0 their files' sizes and checksums. Rank 0 writes meta.json, moves
// an existing DIR/TAG to DIR/.TAG.old, renames the incoming folder to
// DIR/TAG, flushes DIR, and only then rewrites DIR/latest (atomically) and
// removes the old folder. Killed at any point, the job leaves DIR/latest
// naming a complete checkpoint: the previous tag until latest is rewritten;
// the same tag, replaced, is read from DIR/.TAG.old while DIR/TAG is not yet
// there (ckpt::tag_folder). A failure that is not a kill removes the incoming
// folder. A rank that fails tells the others through the same exchanges, so
// every rank throws instead of waiting.
//
// One job writes a folder at a time: rank 0 holds DIR/.zero-lock (flock) from
// the first save (or Engine::open_checkpoint_dir) until the engine goes, and
// a second job is refused, naming the holder. Whoever takes the lock knows
// every earlier writer is gone, so it removes what their interrupted saves
// left (ckpt::remove_interrupted_saves): .TAG.incoming folders, a .TAG.old
// beside a whole TAG, latest's temporaries; `zero checkpoint verify --clean`
// does the same when no job holds the lock. SIGINT, SIGTERM and SIGHUP that
// arrive during a save, in a process that left them at their default action
// (a program with its own handler keeps them), are held: the save stops at
// its next check, every rank agrees it failed, rank 0 removes the incoming
// folder, and the signal is raised again, ending the process as it would
// have. Only SIGKILL (or a crash) leaves an incoming folder, for the next
// writer to remove.
#include "engine_checkpoint.h"

#include <unordered_set>

#include <sys/statvfs.h>

#include <cstdio>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

#include "zero/core/error.h"

namespace zero::detail::checkpoints {

// State i's length over group g's sub-groups (a block-wise state's blocks).
int64_t state_numel_of_group(const partition::StateStore& store, size_t i, size_t g) {
  int64_t n = 0;
  for (size_t k = 0; k < store.sub_groups().size(); ++k)
    if (store.sub_groups()[k].group == g) n += store.state_numel(i, k);
  return n;
}

// A state read and written whole (8-bit Adam's codes and scales), not by
// element ranges (fp32 and 16-bit states are: NOTE [16-bit master]).
bool blockwise_state(const optim::FlatOptimizer::StateSpec& spec) { return spec.per_block > 0 || spec.dtype == at::kByte; }

// "fp32", "bf16", "fp16": the precision of the master or of the element-wise states.
std::string precision_name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32"; }

// The master's and the element-wise states' precision, as meta.json records it.
nlohmann::json precision_of(const partition::StateStore& store) {
  std::string states = "fp32";
  for (const auto& spec : store.state_specs())
    if (blockwise_state(spec)) states = "8bit";
    else states = precision_name(spec.dtype);
  return {{"master", precision_name(store.master_dtype())}, {"states", states}};
}

bool has_block_states(const partition::StateStore& store) {
  for (const auto& spec : store.state_specs())
    if (blockwise_state(spec)) return true;
  return false;
}

std::string part_name(int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05lld", static_cast<long long>(rank));
  return buf;
}

int64_t statvfs_free(const std::string& folder) {
  struct statvfs st {};
  if (::statvfs(folder.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

// Every rank's value of `v`, by rank (this rank's alone without a group).
std::vector<int64_t> everyone(Comm* comm, int64_t v, const std::string& what) {
  if (comm == nullptr) return {v};
  return comm->exchange(v, what);
}

// After a step every rank may have failed on its own: each says so, and all
// throw together (the failing rank its own error).
void agree(Comm* comm, const std::exception_ptr& mine, const std::string& what) {
  const auto status = everyone(comm, mine ? 1 : 0, what);
  if (mine) std::rethrow_exception(mine);
  for (size_t r = 0; r < status.size(); ++r) {
    if (status[r] != 0)
      throw IoError(what + ": rank " + std::to_string(r) + " failed (its own error names the cause); nothing committed");
  }
}

at::Tensor generator_state(at::Device d) { return at::globalContext().defaultGenerator(d).get_state(); }
void set_generator_state(at::Device d, const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(d);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::vector<std::pair<std::string, at::Tensor>> extra_state(torch::nn::Module& model,
                                                            const partition::FlatParameters& flat, bool with_frozen) {
  std::unordered_set<const void*> grouped;  // in stage 3's frozen groups
  for (const auto& slot : flat.all_slots()) grouped.insert(slot.param.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true))
    if (with_frozen && !item.value().requires_grad() && grouped.count(item.value().unsafeGetTensorImpl()) == 0)
      out.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers(true))
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  return out;
}

std::vector<size_t> frozen_groups(const partition::FlatParameters& flat) {
  std::vector<size_t> out;
  for (size_t g = 0; g < flat.all_groups().size(); ++g)
    if (flat.all_groups()[g].frozen) out.push_back(g);
  return out;
}

void load_frozen_groups(partition::ZeroOptimizer& opt,
                        const std::function<at::Tensor(const partition::ParamSlot& slot)>& value_of) {
  at::NoGradGuard no_grad;
  const auto& flat = opt.parameters();
  for (size_t g : frozen_groups(flat)) {
    const auto& grp = flat.all_groups()[g];
    std::vector<at::Tensor> values;
    for (size_t i : grp.slots) values.push_back(value_of(flat.all_slots()[i]));
    at::Tensor chunk = at::empty({grp.chunk_numel}, at::TensorOptions().dtype(flat.full(g).scalar_type()));
    partition::copy_chunk_of(values, opt.partition_rank() * grp.chunk_numel, chunk);
    opt.write_frozen_shard(g, chunk);
  }
}

}  // namespace zero::detail::checkpoints
