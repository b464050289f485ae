// Engine checkpoints: save_checkpoint, load_checkpoint, load_weights
// (docs/checkpoints.md, NOTE [checkpoint mapping], NOTE [checkpoint commit]).
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
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <unordered_set>
#include <map>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "zero/runtime/checkpoint_format.h"
#include "zero/runtime/checkpoint_io.h"
#include "engine_impl.h"
#include "zero/core/error.h"
#include "zero/partition/stage3_plan.h"

namespace zero {
namespace {

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

// NOTE [checkpoint commit]: stop signals during a save. The first is held
// for the save to stop at its next check; a second one (the save is stuck,
// say in an exchange with a peer) ends the process at once, as it would
// have without the save.
std::atomic<int> g_save_signal{0};
void note_save_signal(int sig) {
  int none = 0;
  if (g_save_signal.compare_exchange_strong(none, sig)) return;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

// While one lives, SIGINT/SIGTERM/SIGHUP left at their default action are
// held instead of ending the process; check() throws once one came; the
// destructor restores the actions, lets go of `lock` (the folder's writer
// lock, so the next writer finds no stale file) and raises the signal again.
// One save at a time per process (the signal state is the process's).
class SaveSignals {
 public:
  SaveSignals(std::string what, std::unique_ptr<ckpt::FolderLock>* lock) : what_(std::move(what)), lock_(lock) {
    g_save_signal = 0;
    for (size_t i = 0; i < kSignals.size(); ++i) {
      struct sigaction now {};
      if (::sigaction(kSignals[i], nullptr, &now) != 0 || (now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL)
        continue;
      struct sigaction sa {};
      sa.sa_handler = note_save_signal;
      sa.sa_flags = SA_RESTART;  // other threads' blocking calls go on (io_uring waits, sockets)
      sigemptyset(&sa.sa_mask);
      if (::sigaction(kSignals[i], &sa, &old_[i]) == 0) installed_[i] = true;
    }
  }
  ~SaveSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i)
      if (installed_[i]) ::sigaction(kSignals[i], &old_[i], nullptr);
    const int sig = g_save_signal.exchange(0);
    if (sig == 0) return;
    if (lock_ != nullptr) lock_->reset();
    log::warning(what_ + ": " + name(sig) + " came during the save; the save was stopped and its files removed (the " +
                 "previous checkpoints are as they were), and the signal now ends the process");
    ::raise(sig);  // its default action, now that the save's files are gone
  }
  SaveSignals(const SaveSignals&) = delete;
  SaveSignals& operator=(const SaveSignals&) = delete;

  /// Throws IoError when a held signal came.
  static void check(const std::string& what) {
    const int sig = g_save_signal.load();
    if (sig == 0) return;
    throw IoError(what + ": stopped by " + name(sig) + "; the save's files are removed and the previous checkpoints "
                         "are as they were");
  }

 private:
  static std::string name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP"; }
  std::string what_;
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  std::unique_ptr<ckpt::FolderLock>* lock_;
  std::array<struct sigaction, 3> old_{};
  std::array<bool, 3> installed_{};
};

at::Tensor generator_state(at::Device d) { return at::globalContext().defaultGenerator(d).get_state(); }
void set_generator_state(at::Device d, const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(d);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The model's buffers and frozen parameters (not in the engine's partitions), by name.
std::vector<std::pair<std::string, at::Tensor>> extra_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true))
    if (!item.value().requires_grad()) out.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers(true))
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  return out;
}

// Loads sub-groups window by window (bounded memory whatever a sub-group's
// size), reading the next window, which may be the next sub-group's, while
// this one is checked and copied: straight into the destination tensors when
// they are contiguous fp32 host memory, else through host staging and a copy
// (a device).
class WindowLoader {
 public:
  using Issue = std::function<std::unique_ptr<ckpt::PieceReader::Pending>(size_t k, int64_t first, int64_t count)>;
  WindowLoader(const std::vector<partition::SubGroup>& sub_groups, ckpt::PieceReader& reader, Issue issue)
      : reader_(reader), issue_(std::move(issue)) {
    constexpr int64_t kWindow = int64_t{4} << 20;  // elements (16 MiB a state)
    for (size_t k = 0; k < sub_groups.size(); ++k)
      for (int64_t w = 0; w < sub_groups[k].numel; w += kWindow)
        windows_.push_back({k, w, std::min(kWindow, sub_groups[k].numel - w)});
  }

  /// Sub-group k's turn (in order): fills `dsts` (one per state, k's length).
  void fill(size_t k, const std::vector<at::Tensor*>& dsts) {
    for (; done_ < windows_.size() && windows_[done_].k == k; ++done_) {
      while (issued_ < windows_.size() && issued_ <= done_ + 1) {  // this window and the next in flight
        const Window& w = windows_[issued_++];
        pending_.push_back(issue_(w.k, w.first, w.count));
      }
      const Window& w = windows_[done_];
      bool direct = true;
      for (const at::Tensor* t : dsts)
        direct = direct && t->is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat;
      std::vector<float*> to;
      if (staging_.size() < dsts.size()) staging_.resize(dsts.size());
      for (size_t i = 0; i < dsts.size(); ++i) {
        if (direct) {
          to.push_back(dsts[i]->data_ptr<float>() + w.first);
        } else {
          staging_[i].resize(static_cast<size_t>(w.count));
          to.push_back(staging_[i].data());
        }
      }
      auto pending = std::move(pending_.front());
      pending_.pop_front();
      reader_.complete(*pending, to);
      if (!direct)
        for (size_t i = 0; i < dsts.size(); ++i)
          dsts[i]->narrow(0, w.first, w.count).copy_(at::from_blob(staging_[i].data(), {w.count}, at::kFloat));
    }
  }

 private:
  struct Window {
    size_t k;
    int64_t first, count;
  };
  ckpt::PieceReader& reader_;
  Issue issue_;
  std::vector<Window> windows_;
  size_t issued_ = 0, done_ = 0;
  std::deque<std::unique_ptr<ckpt::PieceReader::Pending>> pending_;
  std::vector<std::vector<float>> staging_;
};

}  // namespace

void detail::set_checkpoint_hooks(Engine& engine, CheckpointHooks hooks) {
  engine.impl().checkpoint_hooks = std::move(hooks);
}

bool detail::save_stop_requested() { return g_save_signal.load() != 0; }

void Engine::open_checkpoint_dir(const std::string& dir) {
  auto& s = *impl_;
  if (s.save_folders.count(dir) != 0) return;
  const std::string what = "checkpoint folder " + dir;
  std::exception_ptr failed;
  std::unique_ptr<ckpt::FolderLock> lock;
  if (s.dist.rank == 0) {
    try {
      if (const std::string problem = ckpt::checkpoint_folder_problem("checkpoint folder", dir); !problem.empty())
        throw IoError(problem);
      const std::string made = ckpt::make_folders_reporting(dir);
      auto attempt = ckpt::FolderLock::try_acquire(dir);
      if (attempt.lock) attempt.lock->remove_when_empty(made);
      using State = ckpt::FolderLock::State;
      if (attempt.state == State::kHeld)
        throw IoError(what + ": another job is saving checkpoints there (" + attempt.holder + ", holding " + dir +
                      "/.zero-lock); two jobs saving into one folder would overwrite each other's files: give this "
                      "one another folder, or stop the other");
      if (attempt.state == State::kUnsupported)
        log::warning(what + ": its file system has no flock (" + attempt.holder + "): saving without a writer lock, "
                     "so nothing stops another job from saving there too");
      lock = std::move(attempt.lock);  // null when held here (the folder under another spelling) or unsupported
      const auto removed =
          attempt.state == State::kAcquired ? ckpt::remove_interrupted_saves(dir) : std::vector<std::string>{};
      if (!removed.empty()) {
        std::string names;
        for (const auto& n : removed) names += (names.empty() ? "" : ", ") + n;
        log::info(what + ": removed what interrupted saves left: " + names);
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  agree(s.comm.get(), failed, what);
  // Every rank writes its own files there: the first rank of each other node
  // checks the folder too (another node may not see it, or not write in it),
  // once rank 0's tidying is over.
  if (s.dist.rank != 0 && s.dist.local_rank == 0) {
    try {
      if (std::string problem = ckpt::save_folder_problem("checkpoint folder", dir); !problem.empty())
        throw IoError(problem);
      ckpt::make_folders(dir);
    } catch (const std::exception& e) {
      failed = std::make_exception_ptr(IoError("rank " + std::to_string(s.dist.rank) + ": " + e.what()));
    }
  }
  agree(s.comm.get(), failed, what);  // the lock, if any, goes with it
  s.save_folders.emplace(dir, std::move(lock));
}

CheckpointStats Engine::save_checkpoint(const std::string& dir, const std::string& tag_in,
                                        const std::string& client_state) {
  auto& s = *impl_;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  if (s.micro_steps % s.gas() != 0) {
    throw UsageError("save_checkpoint between the micro-steps of an accumulation (micro-step " +
                     std::to_string(s.micro_steps) + ", gradient_accumulation_steps " + std::to_string(s.gas()) +
                     "): save after the step() that ends it");
  }
  const std::string tag = tag_in.empty() ? "global_step" + std::to_string(s.global_steps) : tag_in;
  ckpt::check_tag(tag);
  nlohmann::json client;
  try {
    client = nlohmann::json::parse(client_state);
  } catch (const std::exception&) {
  }
  if (!client.is_object()) throw ConfigError({"save_checkpoint: client_state: expected a JSON object; got " +
                                              client_state.substr(0, 200)});
  const std::string what = "save_checkpoint " + dir + "/" + tag;
  open_checkpoint_dir(dir);
  SaveSignals signals(what, &s.save_folders[dir]);  // NOTE [checkpoint commit]: a stop signal ends the save cleanly
  Comm* comm = s.comm.get();
  const int rank = s.dist.rank;
  const std::string incoming = dir + "/." + tag + ".incoming";
  const std::string final_dir = dir + "/" + tag;
  const std::string aside = dir + "/." + tag + ".old";  // a checkpoint of the same tag, while it is replaced
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();
  const int64_t partitions = flat.world_size();
  const bool holds_partition = rank < partitions;

  // This rank's file: its partition of every state, its RNG states.
  ckpt::Layout layout;
  if (holds_partition) {
    const auto& specs = store.state_specs();
    for (size_t g = 0; g < flat.groups().size(); ++g) {
      layout.tensors.push_back({store.names()[0] + "." + std::to_string(g), store.master_dtype(),
                                {flat.groups()[g].chunk_numel}});
      // Each state in its own dtype and length (8-bit Adam: codes and block scales).
      for (size_t i = 0; i < specs.size(); ++i)
        layout.tensors.push_back({store.names()[i + 1] + "." + std::to_string(g), specs[i].dtype,
                                  {state_numel_of_group(store, i, g)}});
    }
  }
  const at::Tensor rng_cpu = generator_state(at::kCPU);
  layout.tensors.push_back({"rng.cpu", at::kByte, {rng_cpu.numel()}});
  at::Tensor rng_dev;
  if (s.device.is_cuda()) {
    rng_dev = generator_state(s.device);
    layout.tensors.push_back({"rng.cuda", at::kByte, {rng_dev.numel()}});
  }
  layout.metadata = {{"format", ckpt::kFormat}, {"rank", std::to_string(rank)}};
  ckpt::Layout model_layout;
  const auto extra = rank == 0 ? extra_state(*s.model) : std::vector<std::pair<std::string, at::Tensor>>{};
  for (const auto& [name, t] : extra) model_layout.tensors.push_back({name, t.scalar_type(), t.sizes().vec()});
  model_layout.metadata = {{"format", ckpt::kFormat}};

  // Rank 0 prepares the folder; every rank checks its disk has room for what it writes.
  std::exception_ptr failed;
  try {
    if (rank == 0) {
      ckpt::make_folders(dir);
      // A save replaces or removes only what saves wrote under its names.
      for (const std::string& path : {final_dir, incoming, aside})
        if (ckpt::path_exists(path) && !ckpt::holds_only_a_saves_files(path))
          throw IoError(path + " exists and is not a checkpoint's folder (it holds files no save writes); a save "
                        "replaces only an earlier checkpoint of its tag: move it, or save with another tag or folder");
      if (const std::string latest = dir + "/latest"; ckpt::path_exists(latest) && !ckpt::is_regular_file(latest))
        throw IoError(latest + " is not a file; a save writes the tag a resume reads there: move it, or save to "
                      "another folder");
      ckpt::remove_tree(incoming);
      ckpt::make_folders(incoming);
    }
  } catch (const std::exception& e) {
    failed = std::make_exception_ptr(IoError(what + ": cannot prepare " + incoming + ": " + e.what()));
  }
  agree(comm, failed, what);
  // From here a failed save removes its folder (every rank has stopped
  // writing once they agree that one failed).
  auto agree_or_clean = [&](std::exception_ptr mine, bool committed = false) {
    if (!mine && !committed) {  // a signal after the commit stops nothing: the checkpoint is whole
      try {
        SaveSignals::check(what);
      } catch (...) {
        mine = std::current_exception();
      }
    }
    try {
      agree(comm, mine, what);
    } catch (...) {
      if (rank == 0) {
        try {
          ckpt::remove_tree(incoming);
        } catch (const std::exception&) {  // the save's own error says more
        }
      }
      throw;
    }
  };
  {
    ckpt::make_header(layout);  // lays the file out: its size
    int64_t needed = layout.file_bytes() + layout.num_sums() * 4;
    if (rank == 0) {
      ckpt::Layout ml = model_layout;
      ckpt::make_header(ml);
      needed += ml.file_bytes() + ml.num_sums() * 4 + (int64_t{1} << 20);  // and meta.json
    }
    const int64_t free = s.checkpoint_hooks.free_bytes ? s.checkpoint_hooks.free_bytes(incoming) : statvfs_free(incoming);
    if (free >= 0 && free < needed) {
      failed = std::make_exception_ptr(IoError(
          what + ": " + incoming + " has " + format_bytes(free) + " free; this rank's files need " +
          format_bytes(needed) + " (" + std::to_string(needed) + " bytes); nothing was written and the previous "
          "checkpoints are as they were"));
    }
  }
  agree_or_clean(failed);

  // Each rank writes its files (NOTE [checkpoint commit]).
  ckpt::TensorFileWriter::Committed mine, model_file;
  int64_t bytes = 0;
  try {
    offload::AioEngine aio(partition::aio_options(s.config.aio));
    ckpt::TensorFileWriter w(incoming + "/" + part_name(rank) + ".safetensors", layout, aio);
    if (holds_partition) {
      const auto& groups = store.sub_groups();
      opt.read_states([&](size_t k, at::Tensor m, std::vector<at::Tensor> st) {
        SaveSignals::check(what);
        const size_t g = groups[k].group;
        w.append(w.tensor(store.names()[0] + "." + std::to_string(g)), m);
        for (size_t i = 0; i < st.size(); ++i) w.append(w.tensor(store.names()[i + 1] + "." + std::to_string(g)), st[i]);
      });
    }
    w.append(w.tensor("rng.cpu"), rng_cpu);
    if (rng_dev.defined()) w.append(w.tensor("rng.cuda"), rng_dev);
    mine = w.commit(incoming + "/" + part_name(rank) + ".sums");
    bytes += mine.bytes;
    if (rank == 0) {
      ckpt::TensorFileWriter mw(incoming + "/model.safetensors", model_layout, aio);
      for (size_t i = 0; i < extra.size(); ++i) mw.append(i, extra[i].second.contiguous());
      model_file = mw.commit(incoming + "/model.sums");
      bytes += model_file.bytes;
    }
    if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("rank_files");
  } catch (...) {
    failed = std::current_exception();
  }
  agree_or_clean(failed);
  const auto sizes = everyone(comm, mine.bytes, what + " (file sizes)");
  const auto header_crcs = everyone(comm, mine.header_crc, what + " (header checksums)");
  const auto sums_crcs = everyone(comm, mine.sums_crc, what + " (block checksums)");

  // Rank 0 commits: meta.json, the folder in place, then latest.
  try {
    if (rank == 0) {
      nlohmann::json files = nlohmann::json::object();
      for (size_t r = 0; r < sizes.size(); ++r)
        files[part_name(static_cast<int64_t>(r)) + ".safetensors"] = {
            {"bytes", sizes[r]}, {"header_crc", static_cast<uint32_t>(header_crcs[r])},
            {"sums_crc", static_cast<uint32_t>(sums_crcs[r])}};
      files["model.safetensors"] = {{"bytes", model_file.bytes}, {"header_crc", model_file.header_crc},
                                    {"sums_crc", model_file.sums_crc}};
      nlohmann::json meta = {
          {"format", ckpt::kFormat},
          {"version", ckpt::kVersion},
          {"tag", tag},
          {"world_size", s.dist.world_size},
          {"stage", s.config.zero.stage},
          {"compute_dtype", ckpt::dtype_name(s.dtype)},
          {"optimizer", s.config.optimizer->type_name},
          {"states", store.names()},
          {"precision", precision_of(store)},
          // Block-wise states (NOTE [8-bit states]) are laid out by the
          // partitions and sub-groups they were saved with.
          {"state_blocks", has_block_states(store)
                               ? nlohmann::json{{"partitions", partitions},
                                                {"sub_group_size", s.config.zero.sub_group_size},
                                                {"min_8bit_size", s.config.optimizer->min_8bit_size}}
                               : nlohmann::json(nullptr)},
          {"global_steps", s.global_steps},
          {"micro_steps", s.micro_steps},
          {"skipped_steps", s.skipped_steps},
          {"applied_steps", s.applied_steps},
          // JSON has no inf or NaN (an fp16 overflow's norm): null stands for them.
          {"last_grad_norm", std::isfinite(s.last_grad_norm) ? nlohmann::json(s.last_grad_norm) : nlohmann::json(nullptr)},
          {"scheduler", s.scheduler ? nlohmann::json{{"last_batch_iteration", s.scheduler->last_batch_iteration()}}
                                    : nlohmann::json(nullptr)},
          {"config", nlohmann::json::parse(s.config.canonical_json)},
          {"layout", ckpt::layout_of(flat, partitions, *s.model).to_json()},
          {"files", files},
          {"client_state", client},
      };
      if (!opt.param_groups().empty()) {
        const auto numels = opt.param_group_numels();
        nlohmann::json pg = nlohmann::json::array();
        for (size_t k = 0; k < opt.param_groups().size(); ++k) {
          const auto& h = opt.param_groups()[k];
          pg.push_back({{"name", h.name},
                        {"lr", h.lr ? nlohmann::json(*h.lr) : nlohmann::json(nullptr)},
                        {"weight_decay", h.weight_decay ? nlohmann::json(*h.weight_decay) : nlohmann::json(nullptr)},
                        {"numel", numels[k]}});
        }
        meta["param_groups"] = pg;
      }
      const auto sc = s.scaler.state();
      meta["loss_scaler"] = {{"cur_scale", sc.cur_scale}, {"cur_iter", sc.cur_iter},
                             {"last_overflow_iter", sc.last_overflow_iter}, {"cur_hysteresis", sc.cur_hysteresis}};
      ckpt::write_file_atomically(incoming + "/meta.json", meta.dump(1));
      if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("meta");
      ckpt::remove_tree(aside);
      if (ckpt::path_exists(final_dir)) ckpt::rename_path(final_dir, aside);
      if (s.checkpoint_hooks.at) s.checkpoint_hooks.at("aside");
      ckpt::rename_path(incoming, final_dir);
      ckpt::sync_path(dir);
      ckpt::write_file_atomically(dir + "/latest", tag + "\n");
      ckpt::remove_tree(aside);
    }
  } catch (const std::exception& e) {
    failed = std::make_exception_ptr(IoError(what + ": committing: " + e.what()));
    // The replaced checkpoint back in its place.
    if (rank == 0 && !ckpt::path_exists(final_dir) && ckpt::path_exists(aside)) std::rename(aside.c_str(), final_dir.c_str());
  }
  agree_or_clean(failed, /*committed=*/true);
  CheckpointStats out;
  out.dir = dir;
  out.tag = tag;
  out.bytes = bytes;
  out.seconds = seconds_since(t0);
  return out;
}

CheckpointStats Engine::load_checkpoint(const std::string& dir, const std::string& tag_in) {
  auto& s = *impl_;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  const std::string tag_dir = ckpt::tag_folder(dir, tag_in);
  const std::string meta_path = tag_dir + "/meta.json";
  const nlohmann::json meta = ckpt::read_meta(tag_dir);
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();
  const auto saved_states = meta.at("states").get<std::vector<std::string>>();
  // Adam's moments in fp32 or bf16 and in 8 bits (NOTE [8-bit states]) are
  // converted into each other as they load: dequantized, or quantized into
  // this run's blocks.
  const std::vector<std::string> adam_names{"fp32_master", "exp_avg", "exp_avg_sq"};
  const std::vector<std::string> q8_names{"fp32_master",        "exp_avg.q8",          "exp_avg.absmax",
                                          "exp_avg_sq.sqrt_q8", "exp_avg_sq.sqrt_absmax", "exp_avg.fp32_blocks",
                                          "exp_avg_sq.fp32_blocks"};
  // (Saved before min_8bit_size: every block in 8 bits, no fp32 blocks.)
  const std::vector<std::string> q8_all_names(q8_names.begin(), q8_names.begin() + 5);
  const bool saved_q8_states = saved_states == q8_names || saved_states == q8_all_names;
  const bool from_8bit = saved_q8_states && store.names() == adam_names;
  const bool to_8bit = saved_states == adam_names && store.names() == q8_names;
  const bool from_all_8bit = saved_states == q8_all_names && store.names() == q8_names;
  if (saved_states != store.names() && !from_8bit && !to_8bit && !from_all_8bit) {
    std::string have, want;
    for (const auto& n : saved_states) have += (have.empty() ? "" : ", ") + n;
    for (const auto& n : store.names()) want += (want.empty() ? "" : ", ") + n;
    throw ConfigError({meta_path + ": the checkpoint holds the states " + have + " (optimizer " +
                       meta.value("optimizer", "?") + "); this engine's optimizer (" + s.config.optimizer->type_name +
                       ") has " + want + ": load the weights alone with engine.load_weights to start the states afresh"});
  }
  if ((from_8bit || to_8bit) && s.dist.rank == 0)
    log::warning(std::string("load_checkpoint: the checkpoint's Adam moments are ") +
                 (from_8bit ? "8-bit (optimizer.params.optim_bits 8) and this run keeps them element by element: they "
                              "are dequantized (each value as its code and block scale give it)"
                            : "element by element and this run keeps them in 8 bits (optimizer.params.optim_bits 8): "
                              "they are quantized into this run's blocks (each value moves by at most half an E4M3 "
                              "step of its block's scale)"));
  // A master or states saved in another precision are converted as they
  // are read (NOTE [16-bit master]): widening is exact, narrowing rounds to
  // nearest; say so.
  {
    // (Checkpoints from before the key: an fp32 master, fp32 or 8-bit states.)
    const bool saved_blocks = meta.contains("state_blocks") && !meta.at("state_blocks").is_null();
    const nlohmann::json saved_precision =
        meta.value("precision", nlohmann::json{{"master", "fp32"}, {"states", saved_blocks ? "8bit" : "fp32"}});
    const nlohmann::json precision = precision_of(store);
    // (8-bit against element-wise moments: said above.)
    const bool states_differ = saved_precision.value("states", "") != precision.value("states", "") &&
                               saved_precision.value("states", "") != "8bit" && precision.value("states", "") != "8bit";
    if ((saved_precision.value("master", "") != precision.value("master", "") || states_differ) && s.dist.rank == 0)
      log::warning("load_checkpoint: the master and optimizer states were saved in " + saved_precision.dump() +
                   "; this run keeps them in " + precision.dump() +
                   ": they are converted as they are read (widened exactly, or rounded to nearest into 16 bits)");
  }
  const ckpt::SavedLayout saved = ckpt::SavedLayout::from_json(meta.at("layout"), meta_path);
  const auto index = saved.index();
  {  // Every parameter of the model is in the checkpoint with its shape, and the other way round.
    std::unordered_set<std::string> model_names;
    for (const auto& slot : flat.slots()) {
      model_names.insert(slot.name);
      auto it = index.find(slot.name);
      if (it == index.end())
        throw IoError(meta_path + ": has no parameter " + slot.name + ": a checkpoint of another model");
      const auto& sp = saved.groups[it->second.first].params[it->second.second];
      if (sp.shape != slot.shape)
        throw IoError(meta_path + ": parameter " + slot.name + " has shape " + c10::str(c10::IntArrayRef(sp.shape)) +
                      " there and " + c10::str(c10::IntArrayRef(slot.shape)) + " in the model: a checkpoint of another model");
    }
    for (const auto& g : saved.groups)
      for (const auto& p : g.params)
        if (model_names.count(p.name) == 0)
          throw IoError(meta_path + ": has parameter " + p.name + ", which the model lacks: a checkpoint of another model");
  }
  auto reader = ckpt::PieceReader::checkpoint(tag_dir, meta, partition::aio_options(s.config.aio));
  ckpt::check_saved_states(tag_dir, meta, *reader);
  const int64_t layout_rank = flat.world_size() == 1 ? 0 : s.dist.rank;
  const auto& groups = store.sub_groups();
  // fp32 states by element ranges, at any world size; block-wise ones
  // (8-bit Adam's) below.
  const auto& specs = store.state_specs();
  std::vector<std::string> by_range{store.names()[0]};
  std::vector<size_t> blockwise;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (blockwise_state(specs[i])) blockwise.push_back(i);
    else by_range.push_back(store.names()[i + 1]);
  }
  if (from_8bit) by_range = {adam_names[0]};  // the moments from the saved blocks below
  if (to_8bit) by_range = adam_names;         // the moments by element ranges, quantized below
  // 8-bit states laid out as this run lays them out (partitions, groups,
  // sub-groups) are read as they are; otherwise each moment is dequantized
  // from the saved blocks and quantized again in this run's (NOTE [8-bit
  // states]), with a warning: a value moves by at most half an E4M3 step of
  // its new block's scale.
  bool requantize = false;
  int64_t saved_sub_group = 0;
  if ((!blockwise.empty() && !to_8bit) || from_8bit) {
    const nlohmann::json want = {{"partitions", flat.world_size()},
                                 {"sub_group_size", s.config.zero.sub_group_size},
                                 {"min_8bit_size", s.config.optimizer->min_8bit_size}};
    nlohmann::json have = meta.value("state_blocks", nlohmann::json(nullptr));
    // (Saved before min_8bit_size: every block in 8 bits, as min_8bit_size 0.)
    if (have.is_object() && !have.contains("min_8bit_size")) have["min_8bit_size"] = 0;
    const bool same_groups = meta.at("layout") == ckpt::layout_of(flat, flat.world_size(), *s.model).to_json();
    if (!have.is_object() || !have.contains("sub_group_size") || !have.at("sub_group_size").is_number_integer() ||
        have.at("sub_group_size").get<int64_t>() < 1)
      throw IoError(meta_path + ": 8-bit optimizer states without their state_blocks layout: a damaged checkpoint");
    saved_sub_group = have.at("sub_group_size").get<int64_t>();
    requantize = !from_8bit && (have != want || !same_groups);
    if (requantize && store.names() != q8_names)
      throw ConfigError({meta_path + ": block-wise states other than 8-bit Adam's load only as they were laid out"});
    if (requantize && s.dist.rank == 0)
      log::warning("load_checkpoint: the 8-bit optimizer states were saved laid out by " + have.dump() + " at stage " +
                   std::to_string(meta.value("stage", -1)) + (same_groups ? "" : " with other groups") +
                   "; this run lays them out by " + want.dump() + " at stage " + std::to_string(s.config.zero.stage) +
                   ": they are dequantized and quantized again in this run's blocks (each value moves by at most "
                   "half an E4M3 step of its new block's scale)");
  }
  // A saved rank's 8-bit tensors of a group, read whole, the last few kept.
  struct SavedQ8 {
    at::Tensor m_codes, m_scale, v_codes, v_scale;
    at::Tensor m_fp32, v_fp32;     // the fp32 blocks' moments (min_8bit_size), or none
    std::vector<int64_t> fp32_at;  // per saved sub-group: where its fp32 blocks' moments start in them
  };
  std::map<std::pair<int64_t, size_t>, SavedQ8> saved_q8;
  std::deque<std::pair<int64_t, size_t>> saved_order;
  auto saved_q8_of = [&](int64_t part, size_t group) -> const SavedQ8& {
    const auto key = std::make_pair(part, group);
    if (auto it = saved_q8.find(key); it != saved_q8.end()) return it->second;
    const std::string file = part_name(part) + ".safetensors", gs = "." + std::to_string(group);
    auto read = [&](const std::string& name, at::ScalarType dtype) {
      at::Tensor t = reader->read_tensor(file, name + gs).reshape({-1}).contiguous();
      if (t.scalar_type() != dtype) throw IoError(tag_dir + "/" + file + ": " + name + gs + " is not " + c10::toString(dtype));
      return t;
    };
    SavedQ8 q{read("exp_avg.q8", at::kByte), read("exp_avg.absmax", at::kFloat), read("exp_avg_sq.sqrt_q8", at::kByte),
              read("exp_avg_sq.sqrt_absmax", at::kFloat)};
    if (saved_states == q8_names) {
      q.m_fp32 = read("exp_avg.fp32_blocks", at::kFloat);
      q.v_fp32 = read("exp_avg_sq.fp32_blocks", at::kFloat);
      // Each saved sub-group's fp32 blocks (its marked scales) take 256 of
      // them each, at least 256 (FlatOptimizer::StateSpec::side_numel).
      const int64_t per_sub = (saved_sub_group + 255) / 256, blocks = q.m_scale.numel();
      const float* ms = q.m_scale.data_ptr<float>();
      int64_t pos = 0;
      for (int64_t b0 = 0; b0 < blocks; b0 += per_sub) {
        q.fp32_at.push_back(pos);
        int64_t marked = 0;
        for (int64_t b = b0; b < std::min(blocks, b0 + per_sub); ++b) marked += ms[b] < 0 ? 1 : 0;
        pos += 256 * std::max<int64_t>(1, marked);
      }
      if (pos != q.m_fp32.numel() || pos != q.v_fp32.numel())
        throw IoError(tag_dir + "/" + file + ": the fp32 blocks of group " + std::to_string(group) +
                      " (exp_avg.fp32_blocks) do not match its marked block scales: a damaged checkpoint");
    }
    if (saved_order.size() >= 2) {
      saved_q8.erase(saved_order.front());
      saved_order.pop_front();
    }
    saved_order.push_back(key);
    return saved_q8.emplace(key, std::move(q)).first->second;
  };
  WindowLoader loader(groups, *reader, [&](size_t k, int64_t first, int64_t count) {
    const auto [g, start, len] = groups[k];
    return reader->issue(by_range,
                         ckpt::map_range(flat, layout_rank, g, start + first, count, saved, index, meta_path), count);
  });
  const std::string own_file = part_name(layout_rank) + ".safetensors";  // stage 0: rank 0's, which holds all
  std::vector<at::Tensor> group_state(specs.size());  // block-wise: group g's saved tensor
  std::vector<int64_t> group_at(specs.size());        // where the next sub-group's part starts in it
  // Sub-group k's moments by value from the saved 8-bit blocks (saved
  // sub-groups split each chunk from its start: element e of a saved chunk
  // is in block (e / S) * ceil(S / 256) + (e % S) / 256): exp_avg into mv,
  // exp_avg_sq into vv and its square root into sv (a saved fp32 block's
  // values as they are, with the square root correctly rounded).
  auto dequantize_saved = [&](size_t k, std::vector<float>& mv, std::vector<float>& sv, std::vector<float>& vv) {
    const auto [g, start, len] = groups[k];
    const int64_t S = saved_sub_group, per_sub = (S + 255) / 256;
    mv.assign(static_cast<size_t>(len), 0.0f);
    sv.assign(static_cast<size_t>(len), 0.0f);
    vv.assign(static_cast<size_t>(len), 0.0f);
    for (const auto& pc : ckpt::map_range(flat, layout_rank, g, start, len, saved, index, meta_path)) {
      const SavedQ8& q = saved_q8_of(pc.part, pc.group);
      const int64_t blocks = q.m_scale.numel(), last = pc.begin + pc.count - 1;
      if (pc.count <= 0) continue;
      if (last >= q.m_codes.numel() || q.v_codes.numel() != q.m_codes.numel() || q.v_scale.numel() != blocks ||
          (last / S) * per_sub + (last % S) / 256 >= blocks)
        throw IoError(tag_dir + "/" + part_name(pc.part) + ".safetensors: its 8-bit states of group " +
                      std::to_string(pc.group) + " do not hold the elements the checkpoint's layout says");
      const uint8_t* mc = q.m_codes.data_ptr<uint8_t>();
      const uint8_t* vc = q.v_codes.data_ptr<uint8_t>();
      const float* ms = q.m_scale.data_ptr<float>();
      const float* vs = q.v_scale.data_ptr<float>();
      for (int64_t e = pc.begin; e < pc.begin + pc.count; ++e) {
        const int64_t b = (e / S) * per_sub + (e % S) / 256;  // below `blocks`: checked for the last
        const size_t d = static_cast<size_t>(pc.dst + e - pc.begin);
        if (ms[b] < 0) {  // a block kept in fp32: its place in the saved sub-group's fp32 moments
          const int64_t pos = q.m_fp32.defined() ? q.fp32_at[static_cast<size_t>(e / S)] +
                                                       static_cast<int64_t>(-ms[b] - 1) * 256 + (e % S) % 256
                                                 : -1;
          if (pos < 0 || pos >= q.m_fp32.numel())
            throw IoError(tag_dir + "/" + part_name(pc.part) + ".safetensors: a block of group " +
                          std::to_string(pc.group) + " is marked fp32 and has no fp32 moments: a damaged checkpoint");
          mv[d] = q.m_fp32.data_ptr<float>()[pos];
          vv[d] = q.v_fp32.data_ptr<float>()[pos];
          sv[d] = static_cast<float>(std::sqrt(static_cast<double>(vv[d])));
          continue;
        }
        mv[d] = optim::dequantize_8bit(mc[e], ms[b]);
        sv[d] = optim::dequantize_8bit(vc[e], vs[b]);
        vv[d] = sv[d] * sv[d];  // as the step squares it
      }
    }
  };
  opt.load_states([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& st, at::Tensor*) {
    const int64_t len = groups[k].numel;
    std::vector<float> mv, sv, vv;
    if (from_8bit) {  // the master by ranges; the moments dequantized, v = s * s as the step squares it
      std::vector<at::Tensor*> dsts{&m};
      loader.fill(k, dsts);
      dequantize_saved(k, mv, sv, vv);
      st[0].copy_(at::from_blob(mv.data(), {len}, at::kFloat));
      st[1].copy_(at::from_blob(vv.data(), {len}, at::kFloat));
      return;
    }
    if (to_8bit) {  // the moments by ranges into fp32, then quantized (the second as its square root)
      at::Tensor tm = at::empty({len}, at::kFloat), tv = at::empty({len}, at::kFloat);
      std::vector<at::Tensor*> dsts{&m, &tm, &tv};
      loader.fill(k, dsts);
      const at::Tensor ts = tv.to(at::kDouble).sqrt().to(at::kFloat);  // correctly rounded, as the kernel's sqrt
      optim::store_8bit(tm.data_ptr<float>(), ts.data_ptr<float>(), tv.data_ptr<float>(), len, store.fp32_blocks(k), st);
      return;
    }
    std::vector<at::Tensor*> dsts{&m};
    for (size_t i = 0; i < st.size(); ++i)
      if (std::find(blockwise.begin(), blockwise.end(), i) == blockwise.end()) dsts.push_back(&st[i]);
    loader.fill(k, dsts);
    const size_t g = groups[k].group;
    if (requantize) {
      dequantize_saved(k, mv, sv, vv);
      optim::store_8bit(mv.data(), sv.data(), vv.data(), len, store.fp32_blocks(k), st);
      return;
    }
    const bool first_of_group = k == 0 || groups[k - 1].group != g;
    for (size_t i : blockwise) {
      if (from_all_8bit && specs[i].side) {  // saved before them: no block in fp32
        st[i].zero_();
        continue;
      }
      if (first_of_group) {
        const std::string name = store.names()[i + 1] + "." + std::to_string(g);
        group_state[i] = reader->read_tensor(own_file, name);
        if (group_state[i].scalar_type() != specs[i].dtype || group_state[i].numel() != state_numel_of_group(store, i, g))
          throw IoError(tag_dir + "/" + own_file + ": " + name + " has another dtype or length than this run's");
        group_at[i] = 0;
      }
      st[i].copy_(group_state[i].reshape({-1}).narrow(0, group_at[i], st[i].numel()));
      group_at[i] += st[i].numel();
    }
  });
  // Buffers and frozen parameters, by name.
  for (const auto& [name, t] : extra_state(*s.model)) {
    if (!reader->has_tensor("model.safetensors", name))
      throw IoError(tag_dir + "/model.safetensors: has no " + name + " (a buffer or frozen parameter of the model)");
    at::Tensor v = reader->read_tensor("model.safetensors", name);
    if (v.sizes() != t.sizes())
      throw IoError(tag_dir + "/model.safetensors: " + name + " has another shape there than in the model");
    t.copy_(v);
  }
  // RNG states, at the world size they were saved with.
  if (meta.at("world_size").get<int64_t>() == s.dist.world_size) {
    const std::string file = part_name(s.dist.rank) + ".safetensors";
    set_generator_state(at::kCPU, reader->read_tensor(file, "rng.cpu"));
    if (s.device.is_cuda() && reader->has_tensor(file, "rng.cuda"))
      set_generator_state(s.device, reader->read_tensor(file, "rng.cuda"));
  } else if (s.dist.rank == 0) {
    log::info("load_checkpoint: saved at " + std::to_string(meta.at("world_size").get<int64_t>()) +
              " ranks, loaded at " + std::to_string(s.dist.world_size) + ": the RNG states start anew");
  }
  // Parameter groups: each group's saved values come back (as a torch
  // optimizer's load_state_dict brings its param_groups' lr and decay).
  if (s.dist.rank == 0 && meta.contains("param_groups") != !opt.param_groups().empty())
    log::warning(opt.param_groups().empty()
                     ? "load_checkpoint: the checkpoint was saved with parameter groups (meta.json param_groups) and "
                       "this run has none: every parameter steps with the config's lr and weight_decay"
                     : "load_checkpoint: this run has parameter groups and the checkpoint none: they step with this "
                       "run's values (InitOptions::param_groups)");
  if (meta.contains("param_groups") && !opt.param_groups().empty()) {
    const auto numels = opt.param_group_numels();
    auto optional_of = [](const nlohmann::json& v) { return v.is_null() ? std::nullopt : std::optional<double>(v.get<double>()); };
    std::vector<std::string> unmatched;
    for (const auto& g : meta.at("param_groups")) {
      const std::string name = g.at("name").get<std::string>();
      const auto& groups = opt.param_groups();
      size_t k = 0;
      while (k < groups.size() && groups[k].name != name) ++k;
      if (k == groups.size()) {
        unmatched.push_back(name);
        continue;
      }
      if (g.contains("numel") && g.at("numel").get<int64_t>() != numels[k] && s.dist.rank == 0)
        log::warning("load_checkpoint: parameter group " + name + " held " + std::to_string(g.at("numel").get<int64_t>()) +
                     " elements when saved and holds " + std::to_string(numels[k]) + " in this run: its match "
                     "takes other parameters now, and they step with the saved group's values");
      partition::ZeroOptimizer::GroupHyper h{name, optional_of(g.at("lr")), optional_of(g.at("weight_decay"))};
      if ((h.lr != groups[k].lr || h.weight_decay != groups[k].weight_decay) && s.dist.rank == 0)
        log::warning("load_checkpoint: parameter group " + name + " has the checkpoint's lr and weight_decay (" +
                     g.at("lr").dump() + ", " + g.at("weight_decay").dump() + "), not this run's");
      opt.set_group_hyper(k, h);
    }
    if (!unmatched.empty() && s.dist.rank == 0)
      log::warning("load_checkpoint: the checkpoint's parameter groups " + [&] {
        std::string n;
        for (const auto& u : unmatched) n += (n.empty() ? "" : ", ") + u;
        return n;
      }() + " are not this run's: their values are not used");
  }
  s.global_steps = meta.at("global_steps").get<int64_t>();
  s.micro_steps = meta.at("micro_steps").get<int64_t>();
  s.skipped_steps = meta.at("skipped_steps").get<int64_t>();
  s.applied_steps = meta.at("applied_steps").get<int64_t>();
  s.last_grad_norm = meta.at("last_grad_norm").is_null() ? NAN : meta.at("last_grad_norm").get<double>();
  if (s.scheduler && meta.at("scheduler").is_object())
    s.scheduler->set_last_batch_iteration(meta.at("scheduler").at("last_batch_iteration").get<int64_t>());
  const auto& sc = meta.at("loss_scaler");
  s.scaler.load_state({sc.at("cur_scale").get<double>(), sc.at("cur_iter").get<int64_t>(),
                       sc.at("last_overflow_iter").get<int64_t>(), sc.at("cur_hysteresis").get<int64_t>()});
  s.loss_sum = torch::Tensor();
  s.loss_count = 0;
  CheckpointStats out;
  out.dir = dir;
  out.tag = meta.value("tag", "");
  out.bytes = reader->bytes_read();
  out.seconds = seconds_since(t0);
  out.client_state = meta.at("client_state").dump();
  return out;
}

namespace {

// "bf16" for the model's dtypes, safetensors' names ("BF16") for a file's.
std::string names_list(const std::vector<std::string>& names, size_t shown = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

// A prefix that would make the file's names match `missing`, said as the
// option that applies it, or "".
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<ckpt::WeightTensor>& tensors) {
  for (const auto& want : missing) {
    for (const auto& t : tensors) {
      if (t.name.size() > want.size() && t.name.compare(t.name.size() - want.size(), want.size(), want) == 0)
        return "; the file names it " + t.name + ": LoadWeightsOptions::strip_prefix \"" +
               t.name.substr(0, t.name.size() - want.size()) + "\" would match";
      if (want.size() > t.name.size() && want.compare(want.size() - t.name.size(), t.name.size(), t.name) == 0)
        return "; the file has " + t.name + ": LoadWeightsOptions::add_prefix \"" +
               want.substr(0, want.size() - t.name.size()) + "\" would match";
    }
  }
  return "";
}

}  // namespace

CheckpointStats Engine::load_weights(const std::string& path, const LoadWeightsOptions& options) {
  auto& s = *impl_;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  const ckpt::WeightFiles files = ckpt::WeightFiles::resolve(path);
  auto rename = [&options](const std::string& name) {
    std::string n = name;
    if (!options.strip_prefix.empty() && n.rfind(options.strip_prefix, 0) == 0) n = n.substr(options.strip_prefix.size());
    n = options.add_prefix + n;
    return options.rename ? options.rename(n) : n;
  };
  ckpt::SavedLayout saved;
  std::vector<ckpt::WeightTensor> tensors;
  auto reader = ckpt::PieceReader::weights(files, rename, &saved, &tensors, partition::aio_options(s.config.aio));
  auto& opt = *s.optimizer;
  const auto& flat = opt.parameters();
  const auto& store = opt.store();

  // Every name of each laid-out parameter (tied ones have several): the file
  // may hold it under any of them.
  std::unordered_map<const void*, std::vector<std::string>> names_of;
  for (const auto& item : s.model->named_parameters(true)) names_of[item.value().unsafeGetTensorImpl()].push_back(item.key());
  auto index = saved.index();
  std::unordered_set<std::string> used;
  std::vector<std::string> missing, tied_unused;
  for (const auto& slot : flat.slots()) {
    std::string found = index.count(slot.name) ? slot.name : "";
    for (const auto& alias : names_of[slot.param.unsafeGetTensorImpl()])
      if (found.empty() && index.count(alias)) found = alias;
    if (found.empty()) {
      missing.push_back(slot.name);
      continue;
    }
    if (found != slot.name) saved.aliases[slot.name] = found;
    used.insert(found);
    // A tied parameter (tie_word_embeddings: lm_head.weight is
    // model.embed_tokens.weight) takes its first name's tensor, as
    // transformers' tie_weights does; a tensor of the file under another of
    // its names is not used, and is named.
    for (const auto& n : names_of[slot.param.unsafeGetTensorImpl()])
      if (n != found && index.count(n) && used.insert(n).second) tied_unused.push_back(n + " (tied to " + found + ")");
  }
  if (!missing.empty()) {
    // A tensor of the name that is not floating point (an int32 table where
    // the model has a weight) is there, but not weights.
    for (const auto& want : missing)
      for (const auto& t : tensors)
        if (t.name == want && !at::isFloatingType(t.dtype))
          throw IoError(files.source + ": " + (t.file_name == t.name ? t.name : t.file_name + " (the model's " + t.name + ")") +
                        " in " + t.file + " is " + ckpt::dtype_name(t.dtype) + "; expected a floating-point tensor " +
                        "(F32, F16, BF16 or F64) for the model's parameter");
    throw IoError(files.source + ": has no tensor for " + std::to_string(missing.size()) + " of the model's " +
                  std::to_string(flat.slots().size()) + " parameters: " + names_list(missing) +
                  prefix_hint(missing, tensors) + " (names after LoadWeightsOptions' mapping)");
  }
  index = saved.index();
  const auto extra = extra_state(*s.model);
  for (const auto& [name, t] : extra) used.insert(name);
  if (s.dist.rank == 0) {
    std::map<std::string, int64_t> other_dtype;  // file dtype -> tensors
    std::vector<std::string> unused;
    for (const auto& t : tensors) {
      if (used.count(t.name) == 0) unused.push_back(t.name);
      else if (at::isFloatingType(t.dtype) && t.dtype != s.dtype) ++other_dtype[ckpt::dtype_name(t.dtype)];
    }
    for (const auto& [dtype, n] : other_dtype) {
      // The master is fp32 unless it is 16-bit by the config: a 16-bit file gives it
      // 16-bit values; an fp32 file keeps them whole and only the compute
      // copy is rounded.
      const std::string compute = ckpt::dtype_name(s.dtype);
      // (A 16-bit master, NOTE [16-bit master], is the compute copy's dtype.)
      const std::string how = store.master_dtype() != at::kFloat ? "the " + compute + " master and compute copy are rounded from them"
                              : dtype == "F64"   ? "the fp32 master is rounded from them"
                              : dtype == "F32" ? "the fp32 master keeps them whole, the " + compute +
                                                     " compute copy is rounded from them"
                                               : "the fp32 master starts from the " + dtype + " values";
      log::warning("load_weights " + files.source + ": " + std::to_string(n) + " tensor(s) in " + dtype +
                   ", the model computes in " + compute + ": converted (" + how + ")");
    }
    if (!unused.empty())
      log::warning("load_weights " + files.source + ": " + std::to_string(unused.size()) +
                   " tensor(s) the model has no parameter or buffer for, not loaded: " + names_list(unused, 8));
    if (!tied_unused.empty())
      log::warning("load_weights " + files.source + ": " + std::to_string(tied_unused.size()) +
                   " tensor(s) of tied parameters not used: " + names_list(tied_unused, 8) +
                   ": the model shares one tensor between the names (tie_word_embeddings), loaded from the first, "
                   "as transformers does; the file's other copy is left out");
  }

  const int64_t layout_rank = flat.world_size() == 1 ? 0 : s.dist.rank;
  const auto& groups = store.sub_groups();
  WindowLoader loader(groups, *reader, [&](size_t k, int64_t first, int64_t count) {
    const auto [g, start, len] = groups[k];
    return reader->issue({"fp32_master"},
                         ckpt::map_range(flat, layout_rank, g, start + first, count, saved, index, files.source),
                         count);
  });
  opt.load_states([&](size_t k, at::Tensor& m, std::vector<at::Tensor>& st, at::Tensor*) {
    loader.fill(k, {&m});
    store.start_states(k, st);  // (8-bit Adam's fp32 blocks marked again)
  });
  for (const auto& [name, t] : extra) {
    if (!reader->has_tensor("", name)) continue;
    at::Tensor v = reader->read_tensor("", name);
    if (v.sizes() != t.sizes())
      throw IoError(files.source + ": " + name + " has shape " + c10::str(v.sizes()) + " there and " +
                    c10::str(t.sizes()) + " in the model");
    t.copy_(v);
  }
  CheckpointStats out;
  out.dir = files.source;
  out.bytes = reader->bytes_read();
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace zero
